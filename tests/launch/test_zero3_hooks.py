"""Recompute under ZeRO-3 runs no ZeRO-3 hook: counted from DeepSpeed's own coordinator and collectives on 2 gloo
ranks (one launch of tests/zero3_worker.py, the trainer's engine set-up), with gradients unchanged."""
import json
import math

import pytest
import torch

from conftest import ROOT, launch_cmd, run_launch
from families import FAMILIES
from zero3_worker import COMPILED, COMPOSED, OFFLOAD, STEPS, STEPS_COMPILED

STEADY = 2  # the coordinator records its trace in the first step, uses it from the second


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    proc = run_launch(launch_cmd(ROOT / "tests" / "zero3_worker.py", [str(out)]), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for case, tensors in zip(ranks[0], torch.load(out / "grads0.pt"), strict=True):  # rank 0's gradients
        case.update(tensors)
    cases = {(c["variant"], c["policy"], c["backend"]): (c, ranks[1][i]) for i, c in enumerate(ranks[0])}
    cases["families"] = [json.loads((out / f"families{r}.json").read_text()) for r in range(2)]
    cases["sp"] = json.loads((out / "sp0.json").read_text())
    return cases


LEAF_RECOMPUTE = [("leaf", "full", "torch"), ("leaf", "full", "deepspeed"), ("leaf", "op", "auto")]


@pytest.mark.parametrize("key", LEAF_RECOMPUTE, ids=lambda k: "-".join(k))
def test_leaf_layers_recompute_without_fetching(cases, key):
    none, _ = cases[("leaf", "none", "auto")]
    case, _ = cases[key]
    assert case["leaf_layers"]
    for step, base in zip(case["steps"][STEADY:], none["steps"][STEADY:]):
        # one fetch per layer for its forward and one for its backward, none in the recompute
        assert step["fetches"]["recompute"] == 0
        assert step["fetches_per_layer"]["forward"] == [1] * 4
        assert step["fetches_per_layer"]["backward"] == [1] * 4
        assert step["fetches"] == base["fetches"]
        # what is gathered equals no recompute's, count and bytes
        assert step["all_gathers"] == base["all_gathers"] > 0
        assert step["all_gather_bytes"] == base["all_gather_bytes"]


def test_hooked_submodules_fetch_again_in_recompute(cases):
    """The counter sees what leaf layers remove: with every submodule hooked, 12 fetches per layer recompute."""
    case, _ = cases[("hooked", "full", "auto")]
    assert not case["leaf_layers"]
    assert all(s["fetches_per_layer"]["recompute"] == [12] * 4 for s in case["steps"][STEADY:])


@pytest.mark.parametrize("key", LEAF_RECOMPUTE + [("leaf", "none", "auto"), ("hooked", "full", "auto")],
                         ids=lambda k: "-".join(k))
def test_per_step_state_stays_flat(cases, key):
    for rank_case in cases[key]:
        steps = rank_case["steps"]
        assert len(steps) == STEPS > STEADY + 1
        assert len({s["fwd_module_stack"] for s in steps}) == 1, [s["fwd_module_stack"] for s in steps]
        assert all(s["trace_complete"] for s in steps[STEADY - 1:])  # complete from the second step on


def test_hooked_layers_get_deepspeeds_reentrant_checkpoint(cases):
    """Without leaf layers ZeRO-3 hooks run inside each recompute: backend auto picks DeepSpeed's reentrant
    checkpoint, and torch's, when forced, leaves 2 entries per layer per step on DeepSpeed's stack."""
    assert cases[("hooked", "full", "auto")][0]["plan_backend"] == "deepspeed"
    forced, _ = cases[("hooked", "full", "torch")]
    stack = [s["fwd_module_stack"] for s in forced["steps"]]
    assert [b - a for a, b in zip(stack, stack[1:])] == [8] * (STEPS - 1)


POLICIES = ("none", "full", "every:2", "sqrt", "selective:attn", "selective:mlp", "op", "modules")


def _grads(cases, variant, policy):
    key = next(k for k in cases if k[:2] == (variant, policy) and cases[k][0]["grads"])
    return cases[key][0]["grads"]


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_hooked_run_and_no_recompute(cases, policy):
    leaf = _grads(cases, "leaf", policy)
    assert _max_diff(leaf, _grads(cases, "hooked", policy)) < 1e-6
    assert _max_diff(leaf, _grads(cases, "leaf", "none")) < 1e-6


@pytest.mark.parametrize("key", [("compiled", p, b) for p, b in COMPILED], ids=lambda k: "-".join(k[1:]))
def test_compiled_layers_train_as_eager_ones_and_compile_only_in_the_warm_up(cases, key):
    """train.compile under ZeRO-3 on 2 ranks with leaf layers: the first backward's gradients and 4 steps' losses
    equal the eager run's; from the third step on nothing compiles; the recompute fetches nothing, as eager; the
    activations kept are eager's."""
    compiled, compiled1 = cases[key]
    eager, _ = cases[("leaf", *key[1:])]
    assert compiled["compile_line"].startswith("compile: each decoder layer's forward under torch.compile")
    # a profiled step calls compiled code once per layer; DeepSpeed's reentrant checkpoint calls each layer's compiled
    # forward again in its recompute (torch's checkpoint recomputes inside the compiled backward)
    assert compiled["compiled_calls"] == (8 if key[2] == "deepspeed" else 4)
    assert eager["compiled_calls"] == 0
    assert _max_diff(compiled["grads"], eager["grads"]) < 1e-5
    assert len(compiled["losses"]) == STEPS_COMPILED
    assert max(abs(a - b) for a, b in zip(compiled["losses"], eager["losses"])) < 1e-3
    assert compiled["late_compiles"] == [] and compiled1["late_compiles"] == []
    # what the compiled layers keep for the backward is the eager layers' (within 10%): no gathered weight among it
    # (torch 2.11's compiled layers keep every layer's gathered weights: 5x here; train.compile refuses that torch)
    assert compiled["activation_bytes"] <= 1.1 * eager["activation_bytes"], (compiled["activation_bytes"],
                                                                              eager["activation_bytes"])
    for step, base in zip(compiled["steps"][STEADY:], eager["steps"][STEADY:]):
        assert step["fetches"] == base["fetches"] and step["fetches"]["recompute"] == 0
        assert step["all_gather_bytes"] == base["all_gather_bytes"]


@pytest.mark.parametrize("key", [case[:3] for case in OFFLOAD], ids=lambda k: "-".join(k))
def test_offloaded_recompute_under_zero3_equals_no_recompute(cases, key):
    """memtrain's offload of checkpointed inputs under ZeRO-3, as a GPU run sets it up (gpu-check's
    memtrain:full+offload and +compile among them): inputs go to the host on both ranks, the gradients are no
    recompute's, and offload adds no fetch: with leaf layers the recompute fetches nothing; sqrt's segments (hooked
    submodules inside) fetch what they fetch without offload. DeepSpeed's module stack stays flat."""
    case, case1 = cases[key]
    none, _ = cases[("leaf", "none", "auto")]
    peer = cases[("leaf", "sqrt", "auto")][0] if key[1] == "sqrt" else none
    assert case["leaf_layers"] == (key[1] != "sqrt") and min(len(case["steps"]), len(peer["steps"])) > STEADY
    assert case["plan_backend"] == ("torch" if key[2] == "torch" else "deepspeed")
    # every recomputed unit but the last offloads (its input is needed first); sqrt's unit is a segment head
    assert case["plan_offload"] == ([True, False, False, False] if key[1] == "sqrt" else [True, True, True, False])
    for rank in (case, case1):
        offloaded, misses = rank["offloaded"]
        assert offloaded >= sum(case["plan_offload"]) * len(case["steps"]) and misses == 0
    assert _max_diff(case["grads"], none["grads"]) < (1e-5 if key[0] == "offload-compiled" else 1e-6)
    assert case["late_compiles"] == []
    for step, base in zip(case["steps"][STEADY:], peer["steps"][STEADY:]):
        assert step["fetches"] == base["fetches"] and step["all_gather_bytes"] == base["all_gather_bytes"]
        assert (step["fetches"]["recompute"] > 0) == (key[1] == "sqrt")
    assert len({s["fwd_module_stack"] for s in case["steps"]}) == 1


@pytest.mark.parametrize("policy, backend", COMPOSED, ids=lambda v: str(v))
def test_composed_policies_and_deepspeed_sublayers_equal_no_recompute(cases, policy, backend):
    """op on the first 2 layers, and the MLP recomputed under DeepSpeed's checkpoint: the plan the trainer builds,
    no recompute's gradients, and fewer activation bytes kept than no recompute (measured)."""
    case, _ = cases[("leaf", policy, backend)]
    none, _ = cases[("leaf", "none", "auto")]
    assert case["plan_layers"] == (["op", "op", "keep", "keep"] if policy.startswith("op") else ["mlp"] * 4)
    assert case["plan_backend"] == ("deepspeed" if backend == "deepspeed" else "torch")
    assert _max_diff(case["grads"], none["grads"]) < 1e-6
    assert case["activation_bytes"] < none["activation_bytes"]


FROZEN = [("frozen", "none", "auto"), ("frozen", "full", "torch"), ("frozen", "full", "deepspeed"),
          ("frozen", "sqrt", "auto"), ("trainable", "op", "auto"),
          *((f"frozen-z{stage}", "full", "deepspeed") for stage in (0, 1, 2))]


@pytest.mark.parametrize("key", FROZEN, ids=lambda k: "-".join(k))
def test_frozen_weights_stay_put_and_the_rest_get_the_full_runs_gradients(cases, key):
    """train.frozen / train.trainable under ZeRO-3 (and ZeRO-0/1/2) on 2 ranks: the trainable parameters' gradients equal the
    all-trainable run's (also with DeepSpeed's reentrant checkpoint and a frozen embedding, where the first
    layer's input needs no grad), frozen parameters get no gradient, no optimizer state and stay bit-identical."""
    rank0, rank1 = cases[key]
    stage = key[0].partition("-")[2]  # z0/z1/z2: compared with the same stage's all-trainable run
    reference = _grads(cases, f"plain-{stage}" if stage else "leaf", "none")
    grads = {n: g for n, g in rank0["grads"].items()}
    frozen = set(rank0["frozen"])
    if key[0].startswith("frozen"):
        assert "model.embed_tokens.weight" in frozen and "model.layers.0.self_attn.q_proj.weight" in frozen
    else:
        assert all(".mlp." not in n for n in frozen) and "model.layers.0.mlp.up_proj.weight" not in frozen
    assert set(grads) == set(reference) - frozen  # a gradient for every trainable parameter, none for a frozen one
    assert _max_diff(grads, {n: reference[n] for n in grads}) < 1e-6
    assert rank0["frozen_changed"] == [] and rank1["frozen_changed"] == []
    trainable = int(rank0["trainable_line"].split()[2].replace(",", ""))
    assert rank0["optimizer_numel"] == rank1["optimizer_numel"] == trainable  # the optimizer holds what trains only
    if key[1:] == ("full", "deepspeed"):
        assert rank0["plan_backend"] == "deepspeed"


@pytest.mark.parametrize("key", [("lora", "none", "auto"), ("lora", "full", "torch"), ("lora", "full", "deepspeed"),
                                 ("lora", "op", "auto")], ids=lambda k: "-".join(k))
def test_lora_gradients_equal_a_plain_peft_models(cases, key):
    """model.lora under ZeRO-3 on 2 ranks, with the trainer's engine set-up: the adapters' gradients equal those of
    a plain peft model with the same weights and batches, without DeepSpeed; only the adapters train."""
    rank0, _ = cases[key]
    reference = rank0["reference"]
    assert reference and set(rank0["grads"]) == set(reference)  # the adapters, and nothing else, have gradients
    assert _max_diff(rank0["grads"], reference) < 1e-5
    assert max(float(g.abs().max()) for g in reference.values()) > 1e-4  # lora_A gets none at B = 0; B does
    assert rank0["frozen_changed"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_build_gets_the_models_own_init(cases, family):
    """Built under zero.Init (2 ranks, the trainer's build_engine) and initialised on gathered parameters as
    transformers' ZeRO-3 path does, also where the init indexes a weight (the padding row of Gemma's, Phi-3's,
    OLMo-2's embedding): each parameter's std (within its sampling error) and mean match a plain build's (another
    draw of the same init), the padding row is zero, and both ranks hold the same weights."""
    stats = cases["families"][0][family]["init"]
    assert stats == cases["families"][1][family]["init"]  # rank 0 initialised, every rank got it
    for name, ((std, mean, pad), (plain_std, plain_mean, plain_pad), numel) in stats.items():
        # two draws' stds differ by about 1 / sqrt(numel) of theirs (a 64-weight gate: 12%); 3 of that, or 15%
        assert std == pytest.approx(plain_std, rel=max(0.15, 3 / math.sqrt(numel)), abs=1e-6), name
        assert mean == pytest.approx(plain_mean, abs=0.01), name
        assert pad == plain_pad, name  # None, or 0.0: the padding row zeroed


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_under_zero3(cases, family):
    """3 steps of each family's tiny model on 2 ranks under ZeRO-3 (tests/zero3_worker.py FAMILY_POLICIES: every
    policy somewhere, sqrt with per-layer arguments, MoE in fp32), set up as src/train.py does. The first loss is
    that of a model initialised as transformers initialises it: near ln(vocab) (a std-1.0 init is far off)."""
    from zero3_worker import FAMILY_POLICIES

    rank0, rank1 = (cases["families"][r][family] for r in (0, 1))
    assert rank0["policy"] == FAMILY_POLICIES[family]
    losses = rank0["losses"] + rank1["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), losses
    assert rank0["losses"][0] == pytest.approx(math.log(257), abs=0.3)
    moe = [line for line in rank0["model_lines"] if line.startswith("moe experts:")]
    assert moe == (["moe experts: transformers' grouped_mm fallback, a matmul per expert (float32: torch's grouped "
                    "matmul takes bf16 only); set model.dtype: bfloat16 for the grouped kernel"]
                   if family in ("mixtral", "qwen2_moe", "qwen3_moe") else [])


def test_multi_head_families_under_sequence_parallel(cases):
    """Ulysses on the families with as many key/value heads as heads (GPT-NeoX, OPT): gradients of one ZeRO-3
    step with parallel.sequence 2 equal one full-sequence rank's (tests/long_context_worker.py has the rest)."""
    from families import SP_MHA

    assert [row["case"] for row in cases["sp"]] == [f"sp-{f}-z3" for f in SP_MHA]
    for row in cases["sp"]:
        assert abs(row["loss"] - row["ref_loss"]) < 1e-5 and row["grad_rel_err"] < 1e-5, row

"""train.compile on CPU in one process: compiled decoder layers (memtrain.recompute.compiled) against eager ones.

Gradients for every policy and both checkpoint backends, memtrain's offload of a compiled layer's inputs, a
recompile after the warm-up as a warning naming its reason, `train.compile: auto`, and the one-line refusals. The
same under ZeRO-3 on 2 ranks, with losses, fetches and recompile counts, is in tests/launch/test_zero3_hooks.py; a stopped
and resumed compiled run is in tests/launch/test_resume.py. A layer counts as compiled when autograd's graph holds its
compiled region's backward (`CompiledFunctionBackward`), which eager layers never make.
"""
import copy
import json

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import ROOT, compiled_calls
from memtrain.config.args import parse_args
from memtrain.config.recipe import DEFAULT_OP_SAVE
from memtrain.errors import UserError
from memtrain.recompute.compiled import CompiledLayers, CompileWatch
from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.meter import ActivationMeter
from memtrain.recompute.policy import plan_for
from memtrain.train.compile_choice import choose_compile
from memtrain.train.preflight import resolve_run

@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Compiled code of other test modules in this process stays out of the counts (and of dynamo's cache limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def base(small_llama):
    return small_llama


def _ids(seq=32):
    return torch.randint(0, 257, (2, seq), generator=torch.Generator().manual_seed(1))


def _step(model, ids):
    """One forward under the activation meter and its backward, profiled: (loss, gradients, bytes saved, calls into
    compiled code)."""
    model.zero_grad(set_to_none=True)
    meter = ActivationMeter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with meter.measure():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, meter.bytes, compiled_calls(prof)


# what runs under ZeRO-3 (none, full on both backends, every:2, selective:attn, op) is checked on 2 ranks there; here
# sqrt segments (ZeRO 0-2 only), a recomputed MLP, and op with its save list
CASES = [("sqrt", "torch"), ("sqrt", "deepspeed"), ("selective:mlp", "torch")]


@pytest.mark.parametrize("policy, backend", CASES, ids=lambda v: str(v))
def test_compiled_layers_give_eager_gradients(base, policy, backend):
    plan = plan_for(policy, 4, backend=backend)
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    apply_plan(eager, plan)
    apply_plan(compiled, plan, CompiledLayers(plan.op_save))
    ids = _ids()
    loss_e, grads_e, _, calls_e = _step(eager, ids)
    _step(compiled, ids)  # compiles
    loss_c, grads_c, _, calls_c = _step(compiled, ids)
    assert calls_e == 0
    # each layer's compiled forward once, and again in the recompute of an eager checkpoint around it (a sqrt
    # segment's, DeepSpeed's); a sublayer's recompute runs inside its layer's compiled backward
    assert calls_c == (4 if policy.startswith("selective") else 8)
    assert abs(loss_c - loss_e) < 1e-5
    for name, g in grads_e.items():
        assert torch.allclose(grads_c[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's GPU random numbers)"))])
def test_the_compiled_recompute_draws_the_forwards_dropout_masks(small_llama, device):
    """Attention dropout on: a layer recomputed inside the compiled backward must draw the masks its forward drew
    (inductor replays the forward's seeds), so compiled full recompute gives compiled no-recompute's gradients."""
    model = copy.deepcopy(small_llama).to(device)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.2
    grads = {}
    for policy in ("none", "full"):
        plan = plan_for(policy, 4, backend="torch")
        compiled = copy.deepcopy(model)
        apply_plan(compiled, plan, CompiledLayers(plan.op_save))
        for seed in (5, 6):
            torch.manual_seed(seed)
            grads[policy, seed] = _step(compiled, _ids().to(device))[1]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(grads["none", 5][name], grads["none", 6][name])  # dropout draws: seeds differ
    for name, g in grads["none", 5].items():
        assert torch.allclose(grads["full", 5][name], g, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("family", ["gemma3_text"])
def test_compiled_families_give_eager_gradients(family):
    """Gemma-3's sliding and full-attention layers (one graph per kind: 2 compiles) compile without a graph break
    and give eager's gradients (all 18 families, measured once: docs/compile.md)."""
    from families import FAMILIES
    from memtrain.config.recipe import ModelSection
    from memtrain.model.build import build_config, build_model

    section = ModelSection(type=family, config=FAMILIES[family])
    torch.manual_seed(0)
    model = build_model(section, build_config(section, vocab_size=257, seq_len=32)).train()
    plan = plan_for("full", 4, backend="torch")
    eager, compiled = copy.deepcopy(model), copy.deepcopy(model)
    apply_plan(eager, plan)
    apply_plan(compiled, plan, CompiledLayers(plan.op_save))
    watch = CompileWatch()
    _, grads_e, _, _ = _step(eager, _ids())
    _, grads_c, _, calls = _step(compiled, _ids())
    watch.step_done(0, warmed_up=False)
    assert calls == 4 and watch.compiles == 2 and watch.graph_breaks == 0
    for name, g in grads_e.items():
        assert torch.allclose(grads_c[name], g, rtol=1e-4, atol=1e-6), name


def test_compiled_bf16_layers_give_eager_gradients_within_bf16_tolerance(base):
    """bf16 (a GPU run's dtype): inductor keeps elementwise chains in fp32 and rounds once, so compiled and eager
    differ by bf16 rounding (measured 1.8% at most, relative, per parameter), not more."""
    plan = plan_for("full", 4, backend="torch")
    eager, compiled = copy.deepcopy(base).to(torch.bfloat16), copy.deepcopy(base).to(torch.bfloat16)
    apply_plan(eager, plan)
    apply_plan(compiled, plan, CompiledLayers(plan.op_save))
    loss_e, grads_e, _, _ = _step(eager, _ids())
    loss_c, grads_c, _, calls = _step(compiled, _ids())
    assert calls == 4 and abs(loss_c - loss_e) < 1e-2
    for name, g in grads_e.items():
        assert ((grads_c[name].float() - g.float()).norm() / g.float().norm()).item() < 5e-2, name


@pytest.mark.parametrize("op_save", [list(DEFAULT_OP_SAVE), ["matmul/2"]], ids=["default", "every-2nd-matmul"])
def test_compiled_selective_checkpoint_saves_what_eager_op_saves(base, op_save):
    """Mode op under compile decides at trace time, from the same save list (each list its own graph, also in one
    process): about what eager op keeps, far less than no recompute keeps."""
    bytes_ = {}
    for policy in ("op", "none"):
        plan = plan_for(policy, 4, backend="torch", op_save=op_save)
        for compiled in (False, True):
            model = copy.deepcopy(base)
            apply_plan(model, plan, CompiledLayers(plan.op_save) if compiled else None)
            bytes_[policy, compiled] = _step(model, _ids())[2]
    # at most what eager op keeps (+5%); less where an output it must save is read by no backward (down_proj's)
    assert 0.8 * bytes_["op", False] <= bytes_["op", True] <= 1.05 * bytes_["op", False], bytes_
    assert bytes_["op", True] < 0.8 * bytes_["none", True], bytes_


def test_a_recompile_after_the_warm_up_is_a_warning_naming_its_reason(base):
    plan = plan_for("full", 4, backend="torch")
    model = copy.deepcopy(base)
    apply_plan(model, plan, CompiledLayers(plan.op_save))
    watch = CompileWatch()
    lines = []
    for step, seq in enumerate((32, 32, 32, 24)):
        _step(model, _ids(seq))
        lines.append(watch.step_done(step, warmed_up=step >= 2))
    assert lines[:3] == [[], [], []] and watch.compiles >= 1  # the first step compiled, quietly
    assert len(lines[3]) == 1 and watch.late == lines[3]
    assert "compiled a recomputed decoder layer again at step 4" in lines[3][0]
    assert "size mismatch" in lines[3][0] and "expected 32, actual 24" in lines[3][0], lines[3][0]


def _gpu_check(tmp_path, name, pairs):
    results = [r for setup, (eager, compiled) in pairs.items()
               for r in ({"setup": setup, "tokens_per_s": eager}, {"setup": f"{setup}+compile", "tokens_per_s": compiled})]
    (tmp_path / f"{name.replace(' ', '-')}.json").write_text(json.dumps({"results": results}))


def test_compile_auto_follows_the_devices_gpu_check(tmp_path):
    plan = plan_for("full", 4, backend="torch")
    h100 = "NVIDIA H100 80GB HBM3"
    gpu = dict(reports=tmp_path, gpu=h100)
    assert not choose_compile(False, plan, "cuda", **gpu).on
    assert choose_compile(True, plan, "cpu", reports=tmp_path).on
    off = choose_compile("auto", plan, "cpu", reports=tmp_path)
    assert not off.on and "off on CPU" in off.line
    missing = choose_compile("auto", plan, "cuda", **gpu)
    assert not missing.on and "no make gpu-check figures for NVIDIA H100 80GB HBM3" in missing.line
    _gpu_check(tmp_path, h100, {"memtrain:full+offload": (100.0, 125.0), "memtrain:op": (100.0, 90.0)})
    on = choose_compile("auto", plan, "cuda", **gpu)  # this run's policy, full, measured faster
    assert on.on and "full+offload 1.25x" in on.line
    slower = choose_compile("auto", plan_for("op", 4, backend="torch"), "cuda", **gpu)
    assert not slower.on and "op 0.90x" in slower.line
    # a policy gpu-check did not run: compiled must have been faster in every pair it measured
    assert not choose_compile("auto", plan_for("every:2", 4, backend="torch"), "cuda", **gpu).on
    # what true refuses, auto turns off, saying why
    refused = choose_compile("auto", plan, "cuda", tp=2, **gpu)
    assert not refused.on and "it cannot be combined with tensor_parallel.autotp_size 2" in refused.line
    with pytest.raises(UserError, match="tensor_parallel.autotp_size 2"):
        choose_compile(True, plan, "cuda", tp=2, **gpu)


def test_compile_refuses_sharded_parameters_on_a_torch_that_keeps_the_gathered_weights(monkeypatch, tmp_path):
    """torch 2.11's compiled layers keep ZeRO-3's gathered weights (measured: tests/launch/test_zero3_hooks.py's activation
    check fails there): true is refused in one line where ZeRO-3 shards the parameters, auto turns off; resident
    parameters (one data-parallel rank) compile on any torch."""
    from memtrain.train.compile_choice import keeps_gathered_weights

    assert keeps_gathered_weights("2.11.0+cu130") and keeps_gathered_weights("2.12.1")
    assert not keeps_gathered_weights("2.13.0+cpu") and not keeps_gathered_weights()  # this suite's pinned torch
    plan = plan_for("full", 4, backend="torch")
    assert choose_compile(True, plan, "cuda", sharded=True, reports=tmp_path, gpu="x").on
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(UserError, match="ZeRO-3's sharded parameters on torch 2.11.0"):
        choose_compile(True, plan, "cuda", sharded=True, reports=tmp_path, gpu="x")
    assert choose_compile(True, plan, "cuda", sharded=False, reports=tmp_path, gpu="x").on
    _gpu_check(tmp_path, "x", {"memtrain:full+offload": (100.0, 125.0)})
    off = choose_compile("auto", plan, "cuda", sharded=True, reports=tmp_path, gpu="x")
    assert not off.on and "sharded parameters" in off.line


DS = str(ROOT / "ds_configs" / "zero3_ckpt.json")


@pytest.mark.parametrize("argv, world, expected", [
    (["--set", "activation_checkpointing.policy=modules"], 2, "policy 'modules'"),
    (["--set", "activation_checkpointing.policy=sqrt"], 2, "policy 'sqrt' under ZeRO-3"),
    (["--set", "activation_checkpointing.policy=selective:attn", "--set", "activation_checkpointing.backend=deepspeed"],
     2, "on activation_checkpointing.backend deepspeed"),
    (["--set", "parallel.sequence=2"], 2, "parallel.sequence 2"),
    (["--deepspeed", str(ROOT / "ds_configs" / "zero3_tp2_ckpt.json")], 2, "tensor_parallel.autotp_size 2"),
    (["--deepspeed", "LEAF:[]"], 2, "the JSON's zero_optimization.leaf_module"),
], ids=["modules", "sqrt-zero3", "deepspeed-sublayer", "ulysses", "autotp", "json-leaf-modules"])
def test_what_cannot_compose_is_one_line_naming_its_key(tmp_path, argv, world, expected):
    argv = [_leaf_json(tmp_path, a.removeprefix("LEAF:")) if a.startswith("LEAF:") else a for a in argv]
    args = parse_args(["--deepspeed", DS, *argv, "--set", "train.compile=true",
                       "--set", "activation_checkpointing.modules=[model.layers.*.mlp]"])
    with pytest.raises(UserError) as e:
        resolve_run(args, world)
    message = str(e.value)
    assert message.startswith("embedded recipe 'tiny': train.compile: true cannot be combined with"), message
    assert expected in message and "\n" not in message


def _leaf_json(tmp_path, classes: str) -> str:
    """ds_configs/zero3_ckpt.json with the JSON's own zero_optimization.leaf_module classes."""
    raw = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    raw["zero_optimization"]["leaf_module"] = {"classes": json.loads(classes)}
    path = tmp_path / "leaf.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_json_that_makes_the_decoder_layer_its_leaf_compiles(tmp_path):
    path = _leaf_json(tmp_path, '["LlamaDecoderLayer"]')
    checked = resolve_run(parse_args(["--deepspeed", path, "--set", "train.compile=true"]), 2)
    assert checked.compile.on and not checked.zero3.leaf_layers  # the JSON decided, and named the layer


@pytest.mark.parametrize("classes, backend", [('["LlamaDecoderLayer"]', "torch"), ("[]", "deepspeed")],
                         ids=["json-leaf-layer", "json-no-leaf"])
def test_make_plan_names_the_checkpoint_backend_the_run_writes(tmp_path, capsys, classes, backend):
    """A JSON that names its own ZeRO-3 leaf modules: make plan --json's checkpoint backend is the one the run
    records in config.json (its ac_plan: resolve_run's plan). Hooks inside each layer (no leaf) take DeepSpeed's
    reentrant checkpoint under backend auto; the layer as the JSON's leaf keeps torch's."""
    from memtrain.tools.plan import main

    path = _leaf_json(tmp_path, classes)
    main(["--deepspeed", path, "--ngpus", "2", "--json"])
    planned = json.loads(capsys.readouterr().out)["ac_backend"]
    assert planned == resolve_run(parse_args(["--deepspeed", path]), 2).plan.to_dict()["backend"] == backend


def test_a_sublayers_offload_cannot_compose():
    plan = plan_for("selective:mlp", 4, ds_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                    backend="torch")
    assert plan.memtrain_offload
    with pytest.raises(UserError, match="cpu_checkpointing of a recomputed sublayer"):
        choose_compile(True, plan, "cuda")


def test_the_plan_says_memory_is_predicted_for_eager_layers():
    checked = resolve_run(parse_args(["--deepspeed", DS, "--set", "train.compile=true"]), 2)
    assert checked.compile.on and "planned for eager layers" in checked.compile.line
    assert any(note.startswith("train.compile: predicted for eager layers") for note in checked.prediction.notes)
    assert not resolve_run(parse_args(["--deepspeed", DS]), 2).compile.line


def test_make_plan_says_its_figures_are_eager_layers(capsys):
    from memtrain.tools.plan import main

    main(["--set", "train.compile=true"])
    assert "train.compile: these are eager layers' figures" in capsys.readouterr().out
    main([])
    assert "train.compile" not in capsys.readouterr().out


def test_gpu_check_compares_compiled_set_ups_with_their_eager_peers():
    from memtrain.tools.bench.table import gpu_check_targets

    results = [{"setup": "torch:noac", "tokens_per_s": 100.0, "peak_gib": 10.0},
               {"setup": "memtrain:full+offload", "tokens_per_s": 80.0, "peak_gib": 4.0, "mfu": 0.30},
               {"setup": "memtrain:full+offload+compile", "tokens_per_s": 96.0, "peak_gib": 4.0, "mfu": 0.36,
                "predicted_peak_gib": 8.0}]
    lines = gpu_check_targets(results)
    assert "- tokens/s, compiled full + offload / eager full + offload: 1.20 (target >= 1.1) - met" in lines
    assert "- best MFU of a compiled set-up: 0.36 (target >= 0.45) - NOT met" in lines
    # its eager-layer prediction (+100% here) is not held against the planner's error target
    assert any(line.startswith("- largest |predicted - measured|") and "not measured" in line for line in lines)

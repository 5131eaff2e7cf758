"""Memory model and planner, checked against measurements on CPU.

* predicted activation_bytes per AC policy vs ac-profile's measured value (5%), for the
  default recipe and for the llama-1b layer shape (hidden 2048, GQA 32/4, vocab 32000) at a
  CPU-sized sequence;
* predicted activation peak of mixed plans vs a real step's tracked live bytes;
* predicted model states, term by term, vs what real DeepSpeed engines hold on 2 CPU ranks
  (ZeRO-1, -2 and -3, with and without offload; tests/ds_model_states.py);
* the DP against brute force; `auto` training the default recipe under a budget that forces a
  mixed plan; `python -m memtrain.tools.plan` on every shipped recipe;
* predict_run for full, sqrt and modules: plans vs the CPU allocator's own memory events (the
  profiler) in a real step; the offload prefetch term vs the restores counted at the copy engine;
  ZeRO-1/2 reduce buckets vs the buffers a real DeepSpeed engine holds in its backward.
"""
import contextlib
from dataclasses import replace
import itertools
import json

import pytest
import torch
from conftest import allocator_peak, FAST, ROOT

from memtrain.tools import ac_profile
from memtrain.memory.predict import LayerChoice, activation_peak, predict
from memtrain.memory.profile import fake_model, mode_plan, profile_activations
from memtrain.memory.rates import Rates, measure_rates
from memtrain.memory.states import ModelStates, model_states
from memtrain.memory.target import Target, make_target, model_and_config
from memtrain.tools import plan as plan_cli
from memtrain.memory import planner
from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import plan_for
from memtrain.config.ds_config import load_ds_config
from memtrain.config.recompute_spec import resolve_recompute
from memtrain.errors import UserError
from memtrain.recompute.meter import ActivationMeter
from memtrain.units import GIB
from memtrain.config.recipe import load_recipe

TOL = 0.05
NO_STATES = ModelStates(0, 0, 0, 0, 0, 0, 0, 0)
ZERO3 = str(ROOT / "ds_configs" / "zero3_ckpt.json")


def _predicted_bytes(profile, recipe, policy, num_layers):
    plan = plan_for(policy, num_layers, recipe.activation_checkpointing, backend="torch")
    return predict(profile, NO_STATES, plan.layers).saved_activations


@pytest.fixture(scope="module")
def tiny():
    """The default recipe at ac-profile's shape (batch 1 x seq 128), fp32 on CPU."""
    recipe = load_recipe(None, ["train.micro_batch_size=1"])
    config = model_and_config(recipe)
    profile = profile_activations(config, Target("cpu", "float32", 1, 128, 1))
    return recipe, config, profile


def test_activation_bytes_match_ac_profile_default_recipe(tiny):
    recipe, config, profile = tiny
    L = config.num_hidden_layers
    policies = ["full", "every:2", "selective:attn", "selective:mlp", "op"]  # not sqrt:
    rows, _ = ac_profile.profile(recipe, policies, seq_len=128, batch=1)  # segments are not modelled
    assert [row["policy"] for row in rows] == ["none", *policies]
    for row in rows:
        predicted = _predicted_bytes(profile, recipe, row["policy"], L)
        assert predicted == pytest.approx(row["activation_bytes"], rel=TOL), row["policy"]


def test_activation_bytes_match_1b_layer_shape():
    """llama-1b's layer shape at seq 64, batch 1, two layers. activation_bytes is what ac-profile
    reports: the ActivationMeter over the forward (measured here without the backward, which
    does not change it, to keep the test fast)."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(str(ROOT / "recipes" / "llama-1b.yaml"),
                         ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=1"])
    config = model_and_config(recipe)
    assert (config.hidden_size, config.intermediate_size, config.num_key_value_heads) == (2048, 5632, 4)
    profile = profile_activations(config, Target("cpu", "float32", 1, 64, 1))
    with torch.device("meta"):  # values do not change sizes: skip the weight init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu").train()
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    for policy in ["none", "full", "selective:attn", "selective:mlp", "op"]:
        apply_plan(model, plan_for(policy, 2, recipe.activation_checkpointing, backend="torch"))
        meter = ActivationMeter()
        with meter.measure():
            loss = model(input_ids=ids, labels=ids).loss
        del loss
        assert _predicted_bytes(profile, recipe, policy, 2) == pytest.approx(meter.bytes, rel=TOL), policy


def test_activation_peak_matches_a_real_step(tiny):
    """Prefix sums of per-layer costs predict the activation peak of real mixed plans: a real fp32
    CPU step of the 4-layer default model with the plan applied, measured by the CPU allocator's own
    memory events (torch.profiler, not memtrain's tracker) within 1%, and the bytes saved for backward by
    saved-tensor hooks on the real tensors (ActivationMeter) within 1%. Measured here: keep exact,
    the mixed plans 0.4-0.7% under (16-21 KB of 3.3-4.5 MB)."""
    from memtrain.recompute.hooks import remove_plan

    recipe, config, profile = tiny
    torch.manual_seed(0)
    model = fake_model(config, config.num_hidden_layers, profile.target)  # real tensors: no fake mode here
    ids = torch.randint(0, config.vocab_size, (1, profile.target.seq_len), generator=torch.Generator().manual_seed(0))
    for plan in [("keep",) * 4, ("full", "op", "mlp", "attn"), ("attn", "keep", "full", "op")]:
        apply_plan(model, mode_plan(model, plan))
        measured = allocator_peak(model, ids)
        meter = ActivationMeter()
        with meter.measure():
            loss = model(input_ids=ids, labels=ids).loss
        del loss
        remove_plan(model)
        assert activation_peak(profile, plan)[0] == pytest.approx(measured, rel=0.01), plan
        assert predict(profile, NO_STATES, plan).saved_activations == pytest.approx(meter.bytes, rel=0.01), plan


def test_dp_is_exact_and_beats_uniform_policies(tiny):
    """Against every one of the 5^4 plans, at budgets from 'nothing fits' to 'everything fits'."""
    _, _, profile = tiny
    choices = planner.available_choices(profile, "torch", offload=False)
    rates = measure_rates()
    seconds = {c: planner.choice_seconds(profile, rates, c) for c in choices}
    plans = list(itertools.product(choices, repeat=profile.num_layers))
    peaks = {p: activation_peak(profile, p)[0] for p in plans}
    lo, hi = min(peaks.values()), max(peaks.values())
    mixed = 0
    for limit in [lo - 1] + [lo + (hi - lo) * k // 10 for k in range(11)]:
        fitting = [p for p in plans if peaks[p] <= limit]
        best = min((sum(seconds[c] for c in p) for p in fitting), default=None)
        chosen = planner.solve(profile, limit, choices, seconds)
        assert (chosen is None) == (best is None) == (planner.feasible(profile, limit, choices) is None)
        if chosen is None:
            continue
        cost = sum(seconds[c] for c in chosen)
        assert peaks[chosen] <= limit and cost == pytest.approx(best, rel=1e-9)
        for c in choices:  # at least as fast as every uniform policy that also fits
            if peaks[(c,) * profile.num_layers] <= limit:
                assert cost <= seconds[c] * profile.num_layers + 1e-12
        mixed += len(set(chosen)) > 1
    assert mixed, "some budget should call for a mixed plan"
    assert planner.smallest_peak(profile, choices)[0] == pytest.approx(lo, rel=0.001)


def test_dp_with_offload_keeps_its_plans_within_the_limit(tiny):
    """With full+offload among the choices the DP carries the prefetch term in its state: every
    plan it returns fits under the exact model (activation_peak with PREFETCH_DEPTH), and some
    limit calls for offload."""
    _, _, profile = tiny
    choices = planner.available_choices(profile, "torch", offload=True)
    assert LayerChoice("full", offload=True) in choices
    rates = Rates(1e12, 1e11, 1e10, "cpu")
    seconds = {c: planner.choice_seconds(profile, rates, c) for c in choices}
    plans = [p for p in itertools.product(choices, repeat=profile.num_layers) if not p[-1].offload]
    peaks = sorted({activation_peak(profile, p)[0] for p in plans})
    offloaded = 0
    for limit in peaks[:: max(1, len(peaks) // 40)]:
        chosen = planner.solve(profile, limit, choices, seconds)
        if chosen is not None:
            assert activation_peak(profile, chosen)[0] <= limit, (limit, chosen)
            offloaded += any(c.offload for c in chosen)
    assert offloaded


def test_nothing_fits_says_what_would(tiny):
    recipe, config, profile = tiny
    ds = load_ds_config(ZERO3)
    target = Target("cpu", "float32", 8, 128, 1)
    profile8 = profile_activations(config, target)
    states = model_states(profile8, ds, target)
    smallest = planner.smallest_peak(profile8, planner.available_choices(profile8, "torch", False))[0] + states.total
    recipe8 = load_recipe(None, ["activation_checkpointing.policy=auto",
                                 f"activation_checkpointing.memory_budget={(smallest - (1 << 16)) / GIB:.9f}"])
    with pytest.raises(UserError) as e:
        spec = resolve_recompute(ds, recipe8.activation_checkpointing, "cpu")
        planner.auto_plan(spec, recipe8, ds, 1, config, target)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("activation_checkpointing.memory_budget: nothing fits")
    assert "smallest achievable predicted peak" in msg and "would fit: train.micro_batch_size=7" in msg
    advice = planner.suggest_fit(load_recipe(None), ds, 1, int(smallest) - (1 << 16))  # for an OOM report
    assert "\n" not in advice and "would fit: train.micro_batch_size=7" in advice


CPU_RECIPES = (None, "gpt2-small", "qwen2-tiny")  # the rest are GPU recipes: planned for the GPU (bf16) from here


@pytest.mark.parametrize("recipe", [None, *sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))])
def test_plan_cli_every_recipe(recipe, capsys):
    """make plan --json on the embedded recipe and every shipped one: JSON that parses (LoRA's section as the
    recipe writes it), with the policies' peaks in order, and a held-out eval's peak below every training peak."""
    path = ROOT / "recipes" / f"{recipe}.yaml"
    argv = ["--json", "--deepspeed", ZERO3, "--set", f"data.eval_paths=[{ROOT / 'README.md'}]"] + (
        ["--recipe", str(path)] if recipe else [])
    gpu = recipe not in CPU_RECIPES
    if recipe and load_recipe(str(path), []).data.seq_len > 8192:  # the long recipes: their sections, not the
        argv += ["--set", "data.seq_len=8192"]  # 15 s their full length takes to profile on fake tensors
    plan_cli.main(argv + (["--device", "cuda"] if gpu else []))
    report = json.loads(capsys.readouterr().out)
    policies = report["policies"]
    assert {"none", "full"} <= {p["policy"] for p in policies.values()}
    keep, full = policies["keep"], policies["full"]
    assert 0 < full["saved_activations"] < keep["saved_activations"]
    # (equal where the optimizer step's peak is above both: an 8B model at 8,192 tokens)
    assert full["peak"] <= keep["peak"] and keep["peak"] > report["model_states"]["total"] > 0
    assert report["target"]["dtype"] == ("bfloat16" if gpu else "float32")
    # one no-grad forward: the model states and more than the running hidden states, less than any training step
    assert report["model_states"]["total"] < report["eval_peak"] <= min(p["peak"] for p in policies.values())
    lora = load_recipe(str(path) if recipe else None, []).model.lora
    assert report["target"]["lora"] == (lora and lora.model_dump(mode="json"))


def test_plan_cli_budget_table(capsys):
    plan_cli.main(["--deepspeed", ZERO3, *FAST, "--budget", "2GiB"])
    out = capsys.readouterr().out
    assert "max micro-batch" in out and "auto under 2 GiB:" in out
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--budget", "lots"])
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


# --------------------------------------------------------------------------- any ACPlan, against the allocator


def _real_model(recipe, layers: int, batch: int = 4, seq: int = 128):
    config = model_and_config(recipe)
    target = Target("cpu", "float32", batch, seq, 1)
    torch.manual_seed(0)
    model = fake_model(config, layers, target)  # real tensors: no fake mode here
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return config, target, model, ids


@pytest.mark.parametrize("policy, modules", [
    ("full", ()),
    ("sqrt", ()),  # segments of 2 layers: (0, 2), (2, 4)
    ("modules", ("model.layers.*.self_attn", "model.layers.*.mlp")),  # both sublayers: a measured mode
    ("modules", ("model.layers.0", "model.layers.*.mlp")),  # layer 0 whole, then the MLPs of the others
])
def test_predict_run_matches_the_allocator(policy, modules):
    """predict_run's activation peak for a policy against a real fp32 CPU step of a 4-layer Llama
    with the plan applied, measured by the CPU allocator's own events (10%)."""
    from memtrain.recompute.policy import custom_plan

    recipe = load_recipe(None, ["train.micro_batch_size=4"])
    config, target, model, ids = _real_model(recipe, 4)
    if policy == "modules":
        plan = custom_plan(("keep",) * 4, modules=modules)
    else:
        plan = plan_for(policy, 4, backend="torch")
    assert bool(plan.segments) == (policy == "sqrt")
    pred = planner.predict_run(recipe, load_ds_config(ZERO3), 1, plan, config, target)
    assert not pred.notes
    overlap = modules == ("model.layers.0", "model.layers.*.mlp")  # layer 0's MLP is inside layer 0: skipped, said
    with pytest.warns(RuntimeWarning, match="'model.layers.0.mlp' overlaps 'model.layers.0'") if overlap else \
            contextlib.nullcontext():
        apply_plan(model, plan)
    measured = allocator_peak(model, ids)
    assert pred.activation_peak == pytest.approx(measured, rel=0.10), (policy, modules, pred.phase)


def _hooked(model) -> dict:
    """The modules `apply_plan` actually hooked, read off the model: name -> 'layer' (transformers' per-layer
    checkpoint switched on) or 'forward' (a checkpointed forward)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return {n: "layer" if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing else "forward"
            for n, m in model.named_modules()
            if "_ac_checkpoint" in vars(m) or (isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)}


@pytest.mark.parametrize("modules", [
    ("model.layers.0", "model.layers.0.mlp", "model.layers.*.mlp", "model.layers.1.mlp.down_proj"),
    ("model.layers.*.self_attn", "model.layers.2", "model.layers.3.self_attn.q_proj", "model.layers.3.mlp"),
    ("model.*", "model.layers.*.mlp"),  # model.layers (the list) first: every match inside it is skipped
])
def test_predicted_units_are_the_installed_hooks(modules):
    """Overlapping module patterns: the units the predictor measures (on a 1-layer fake model's paths) are the
    modules whose hooks apply_plan registers on the real 4-layer model, read off that model."""
    import warnings
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memtrain.memory.predict import plan_choices, predicted_paths
    from memtrain.memory.profile import MODULES
    from memtrain.recompute.policy import custom_plan
    from memtrain.recompute.units import model_paths, recompute_units

    recipe = load_recipe(None, ["train.micro_batch_size=1"])
    config, target, model, _ = _real_model(recipe, 4, batch=1, seq=16)
    plan = custom_plan(("keep",) * 4, modules=modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the overlaps, said once per skipped match
        apply_plan(model, plan)
    hooked = _hooked(model)
    assert hooked  # something was installed
    with FakeTensorMode(allow_non_fake_inputs=True):
        one = model_paths(fake_model(config, 1, target))
    units, _ = recompute_units(plan, predicted_paths(one, 4))
    choices, notes = plan_choices(plan, one, 4)
    assert {u.name for u in units} == set(hooked), modules
    # what the per-layer choices stand for, back as module paths
    layers = set()
    for i, choice in enumerate(choices):
        at = f"model.layers.{i}"
        rels = choice.mode[len(MODULES):].split("|") if choice.mode.startswith(MODULES) else \
            {"keep": [], "full": [""], "attn": ["self_attn"], "mlp": ["mlp"]}[choice.mode]
        layers |= {at + (f".{rel}" if rel else "") for rel in rels}
    assert layers == {n for n in hooked if n.startswith("model.layers.")}, (modules, choices)
    outside = sorted(n for n in hooked if not n.startswith("model.layers."))
    assert bool(outside) == any("not modelled" in note for note in notes), notes


def test_predict_run_says_what_it_cannot_model():
    from memtrain.recompute.policy import custom_plan

    recipe = load_recipe(None, ["train.micro_batch_size=1"])
    config = model_and_config(recipe)
    target = Target("cpu", "float32", 1, 128, 1)
    plan = custom_plan(("keep",) * 4, modules=("lm_head", "model.layers.*.mlp"))
    pred = planner.predict_run(recipe, load_ds_config(ZERO3), 1, plan, config, target)
    assert len(pred.notes) == 1 and "lm_head" in pred.notes[0] and "not modelled" in pred.notes[0]
    mlp = planner.predict_run(recipe, load_ds_config(ZERO3), 1, plan_for("selective:mlp", 4, backend="torch"),
                              config, target)
    assert pred.activation_peak == mlp.activation_peak  # the MLP part is modelled as selective:mlp


def test_offload_prefetch_term_matches_restores_on_cpu():
    """memtrain's offload on CPU (synchronous copies, so the restores are observable): a 6-layer
    Llama, full recompute, the inputs of layers 0-4 offloaded. The second step (the host pool is
    warm, so host buffers are not allocated in it) peaks where the model says, with PREFETCH_DEPTH
    restored inputs beside the one in use: the allocator's peak within 2% (the term is ~7% of it),
    and the most restored inputs alive at once, counted at the copy engine, equals the model's."""
    import weakref

    from memtrain.recompute.offload import PREFETCH_DEPTH

    recipe = load_recipe(None, ["train.micro_batch_size=4", "model.config.num_hidden_layers=6"])
    config, target, model, ids = _real_model(recipe, 6)
    plan = plan_for("full", 6, ds_config={"activation_checkpointing": {"cpu_checkpointing": True}}, backend="torch")
    assert plan.memtrain_offload and sum(plan.offload) == 5
    pred = planner.predict_run(recipe, load_ds_config(ZERO3), 1, plan, config, target)
    apply_plan(model, plan)
    copies = model.ac_offloader.copies
    restored, most = [], [0]
    to_device = copies.to_device

    def counting(src):
        t, ready = to_device(src)
        if src.numel() * src.element_size() == target.micro_batch_size * target.seq_len * config.hidden_size * 4:
            restored.append(weakref.ref(t))  # a layer's hidden-state input (not its rotary cos/sin)
            most[0] = max(most[0], sum(r() is not None for r in restored))
        return t, ready

    copies.to_device = counting
    allocator_peak(model, ids)  # warms the host pool
    restored.clear()
    most[0] = 0
    measured = allocator_peak(model, ids)
    input_bytes = profile_activations(config, target).layers["full"].input_bytes
    assert pred.prefetched == PREFETCH_DEPTH * input_bytes and pred.phase.startswith("backward")
    assert most[0] == 1 + pred.prefetched // input_bytes
    assert pred.activation_peak == pytest.approx(measured, rel=0.02), pred.phase


def test_zero12_reduce_buffers_count_in_the_backward_only(tiny):
    """The buckets exist from the first gradient to the end of the backward: they add to the
    backward-phase candidates (head, layers' backward, embedding backward), not to the forward's,
    nor to the update's. A profile whose forward peaks above its backward by less than the buckets: with
    the buckets, the backward is the peak. The reduction's flatten copy lives only between the backward's ops: a
    backward phase holds the larger of it and its own transient, counted by hand here, and the solver's limit is
    the walk's peak to the byte."""
    from dataclasses import replace

    _, config, profile = tiny
    ds = load_ds_config(str(ROOT / "ds_configs" / "zero2_ckpt.json"))
    states = model_states(profile, ds, Target("cpu", "float32", 1, 128, 2))
    assert states.reduce_buckets == 4 * int(5e7) * 2 and states.reduce_scratch > 0
    plan = ("keep",) * 4
    backward, phase = activation_peak(profile, plan)
    assert not phase.startswith("forward")
    keep = replace(profile.layers["keep"], fwd_excess=backward - profile.base + states.backward // 4)
    forward_heavy = replace(profile, layers={**profile.layers, "keep": keep})
    assert activation_peak(forward_heavy, plan)[1].startswith("forward")
    pred = predict(forward_heavy, states, plan)
    assert not pred.phase.startswith("forward") and states.backward == states.reduce_buckets
    keep = profile.layers["keep"]
    by_hand = {  # each backward phase's bytes: activations alive + max(its transient, the copy) + the buckets
        "logits/loss": profile.base + 4 * keep.resident + max(profile.head_excess, states.reduce_scratch),
        "embedding backward": profile.base + profile.head_net + max(profile.tail_excess, states.reduce_scratch),
        **{f"backward of layer {i}": profile.base + (i + 1) * keep.resident + profile.head_net
           + max(keep.bwd_excess, states.reduce_scratch) for i in range(4)}}
    assert pred.activation_peak + pred.reduce_buffers == max(by_hand.values()) + states.backward
    assert pred.peak == states.total + max(by_hand.values()) + states.backward + pred.margin
    for scratch in (0, keep.bwd_excess // 2, 3 * keep.bwd_excess):  # below, and above, a layer's transient
        small = replace(states, reduce_scratch=scratch)
        pred = predict(profile, small, plan)
        need = pred.activation_peak + pred.reduce_buffers
        choices = (LayerChoice("keep"),)
        assert planner.feasible(profile, need, choices, *small.backward_terms) is not None
        assert planner.feasible(profile, need - 1, choices, *small.backward_terms) is None


def test_zero3_backward_releases_gathered_layers_and_counts_the_reduction(tiny):
    """ZeRO-3 keeping every gathered parameter into the backward (2 ranks, the default reuse distance): the backward
    has no prefetch buffer and frees each layer's gathered parameters after its backward (DeepSpeed's
    release_sub_module), and a gradient bucket's reduction flattens it once more, twice on CPU (gloo's copy). Counted
    by hand from the model's own parameters (numel above the persistence threshold): every phase of the walk, the
    peak, and the solver's limit to the byte."""
    from dataclasses import replace

    _, config, profile = tiny
    ds = load_ds_config(ZERO3)
    ds["zero_optimization"].update(reduce_bucket_size=1e5, stage3_prefetch_bucket_size=1e5,
                                   stage3_param_persistence_threshold=128)
    sizes = [p.numel() for p in fake_model(config, 1, profile.target).model.layers[0].parameters()]
    every = [p.numel() for p in fake_model(config, config.num_hidden_layers, profile.target).parameters()]
    gathered_layer = 4 * sum(n for n in sizes if n > 128)
    prefetch = 4 * min(100_000 + max(every), sum(n for n in every if n > 128))
    flat = 4 * min(sum(every), max(100_000, max(every)))
    states = model_states(profile, ds, Target("cpu", "float32", 1, 128, 2))
    # a layer's persistent norms are the model's persistent elements shared over the layers, the final norm's with
    # them: per layer its share of the final norm less released than the layer really gathers (states.zero3_buffers)
    final_norm_share = 4 * (config.hidden_size // config.num_hidden_layers)
    assert states.release.first == prefetch and states.release.per_layer == gathered_layer - final_norm_share
    gathered_layer = states.release.per_layer
    assert states.reduce_scratch == 2 * flat  # the flatten copy and gloo's
    on_gpu = model_states(profile, ds, Target("cuda", "float32", 1, 128, 2))
    assert on_gpu.reduce_scratch == flat and on_gpu.release == states.release
    plan, keep = ("keep",) * 4, profile.layers["keep"]
    released = lambda done: prefetch + done * gathered_layer  # noqa: E731
    by_hand = {
        "logits/loss": profile.base + 4 * keep.resident + profile.head_excess,
        "embedding backward": profile.base + profile.head_net + max(profile.tail_excess, 2 * flat) - released(4),
        **{f"forward of layer {i}": profile.base + i * keep.resident + keep.fwd_excess for i in range(4)},
        **{f"backward of layer {i}": profile.base + (i + 1) * keep.resident + profile.head_net
           + max(keep.bwd_excess, 2 * flat) - released(3 - i) for i in range(4)}}
    pred = predict(profile, states, plan)
    assert pred.peak == states.total + max(by_hand.values()) + pred.margin, (by_hand, pred)
    # a transient large enough that the backward of the top layer is the peak: what the layers below it still hold
    heavy = replace(profile, layers={**profile.layers, "keep": replace(keep, bwd_excess=4 * flat + prefetch)})
    pred = predict(heavy, states, plan)
    assert pred.phase == "backward of layer 3" and pred.released == prefetch
    for scratch in (0, 3 * keep.bwd_excess):
        small = replace(states, reduce_scratch=scratch)
        pred = predict(heavy, small, plan)
        need = pred.activation_peak + pred.reduce_buffers - pred.released
        choices = (LayerChoice("keep"),)
        assert planner.feasible(heavy, need, choices, *small.backward_terms) is not None
        assert planner.feasible(heavy, need - 1, choices, *small.backward_terms) is None

def test_zero3_reduction_under_autotp_counts_the_bucket_deepspeed_reduces(tiny):
    """ZeRO-3 under AutoTP 2 with leaf layers: DeepSpeed reduces a leaf layer's gradients in parameter order, a bucket
    closing before a gradient would overflow reduce_bucket_size or where the partition group changes (the replicated
    norms are partitioned over the TP ranks). Counted by hand from the config's shard shapes: q, k, v, o and gate, up
    fill 77,824 of 100,000 elements and down goes on its own, so the flatten copy is 311,296 B (the traced copy, 2 gloo
    ranks), twice on CPU. Without leaf layers, or without AutoTP, the whole bucket is counted."""
    _, config, _ = tiny
    target = Target("cpu", "float32", 1, 32, 2, tp=2)
    profile = profile_activations(config, target)
    ds = load_ds_config(ZERO3)
    ds["zero_optimization"].update(reduce_bucket_size=100_000, stage3_param_persistence_threshold=1000)
    leaf = {**ds, "zero_optimization": {**ds["zero_optimization"], "leaf_module": {"classes": ["LlamaDecoderLayer"]}}}
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = [hidden * head_dim * heads // 2 for heads in (config.num_attention_heads, config.num_key_value_heads,
                                                              config.num_key_value_heads, config.num_attention_heads)]
    mlp = [hidden * config.intermediate_size // 2] * 3
    assert sum(attention) + sum(mlp) > 100_000 >= sum(attention) + sum(mlp[:2])  # down overflows the bucket
    bucket = sum(attention) + sum(mlp[:2])
    assert 4 * bucket == 311_296
    assert model_states(profile, leaf, target).reduce_scratch == 2 * 4 * bucket  # the flatten copy and gloo's
    assert model_states(profile, leaf, replace(target, device="cuda")).reduce_scratch == 4 * bucket
    assert model_states(profile, ds, target).reduce_scratch == 2 * 4 * 100_000  # no leaf layers: the order unknown
    whole = Target("cpu", "float32", 1, 32, 2)
    assert model_states(profile_activations(config, whole), leaf, whole).reduce_scratch == 2 * 4 * 100_000


def test_zero12_accumulation_partition_comes_with_the_first_reduction(tiny):
    """ZeRO-1/2 with accumulation: the partition a later micro-step's backward makes (ModelStates.accumulating) comes
    at the first bucket reduction, once a bucket's worth of gradients has come in: the top layers' backward, before
    that, does not hold it. Counted by hand from the model's parameters (those outside the layers first, then a
    layer's at a time): every backward phase, the peak, and the solver's limit to the byte."""
    _, config, profile = tiny
    layer = sum(p.numel() for p in fake_model(config, 1, profile.target).model.layers[0].parameters())
    every = sum(p.numel() for p in fake_model(config, config.num_hidden_layers, profile.target).parameters())
    outside, layers = every - config.num_hidden_layers * layer, config.num_hidden_layers
    keep = profile.layers["keep"]
    for stage, bucket in ((1, outside + layer + 1), (2, outside + 1), (2, 10**9), (1, outside)):
        ds = load_ds_config(str(ROOT / "ds_configs" / "zero2_ckpt.json"))
        ds["zero_optimization"].update(stage=stage, reduce_bucket_size=bucket)
        states = model_states(profile, ds, Target("cpu", "float32", 1, 128, 2, grad_accum=2))
        late = min(layers, max(0, -(-(bucket - outside) // layer)))  # layers whose backward starts before a bucket
        assert states.accumulating > 0 and states.release.late == states.accumulating, stage
        made = lambda done: 0 if done < late else states.accumulating  # noqa: E731
        extra = states.backward - states.accumulating
        by_hand = {
            "logits/loss": profile.base + layers * keep.resident + profile.head_excess,
            "embedding backward": profile.base + profile.head_net + max(profile.tail_excess, states.reduction)
            + extra + made(layers),
            **{f"forward of layer {i}": profile.base + i * keep.resident + keep.fwd_excess for i in range(layers)},
            **{f"backward of layer {i}": profile.base + (i + 1) * keep.resident + profile.head_net
               + max(keep.bwd_excess, states.reduction) + extra + made(layers - 1 - i) for i in range(layers)}}
        pred = predict(profile, states, ("keep",) * layers)
        assert pred.peak == states.total + max(by_hand.values()) + pred.margin, (stage, bucket, by_hand, pred)
        need = pred.activation_peak + pred.reduce_buffers - pred.released
        choices = (LayerChoice("keep"),)
        assert planner.feasible(profile, need, choices, *states.backward_terms) is not None
        assert planner.feasible(profile, need - 1, choices, *states.backward_terms) is None
    assert 0 < -(-(outside + layer + 1 - outside) // layer) < layers  # the first case: the top two layers without it

def test_a_layer_without_an_mlp_sublayer_plans_every_other_policy():
    """OPT's MLP is fc1/fc2 directly on the layer: the memory model measures keep/op/attn/full for it (no 'mlp'),
    so every policy but selective:mlp is planned; selective:mlp is one line naming the layer's submodules."""
    from memtrain.config.args import parse_args
    from memtrain.errors import UserError
    from memtrain.train.preflight import resolve_run

    opt = ["model.type=opt", "model.config={hidden_size: 64, ffn_dim: 128, num_hidden_layers: 2, "
           "num_attention_heads: 4, max_position_embeddings: 256, word_embed_proj_dim: 64}",
           "data.random_tokens=true", "data.seq_len=32"]
    recipe = load_recipe(None, opt)
    config = model_and_config(recipe)
    profile = profile_activations(config, Target("cpu", "float32", 1, 32, 1))
    assert set(profile.layers) == {"keep", "op", "attn", "full"}
    argv = ["--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), *sum((["--set", o] for o in opt), [])]
    assert resolve_run(parse_args([*argv, "--set", "activation_checkpointing.policy=full"]), 1).plan.num_recomputed == 2
    with pytest.raises(UserError, match=r"OPTDecoderLayer has no mlp sublayer .* \(its submodules: self_attn, "
                                        r"activation_fn, self_attn_layer_norm, fc1, fc2, final_layer_norm\)"):
        resolve_run(parse_args([*argv, "--set", "activation_checkpointing.policy=selective:mlp"]), 1)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_predict_run_of_a_lora_run_matches_the_allocator(policy):
    """model.lora: the activation peak predicted with the adapters in each layer (base weights frozen, the
    embedding's output requiring grad as the trainer makes it) against a real fp32 CPU step of the same
    adapted 4-layer Llama, measured by the CPU allocator's own events (5%)."""
    from dataclasses import replace

    from memtrain.model.freeze import freeze

    recipe = load_recipe(None, ["train.micro_batch_size=4", "model.lora.r=8"])
    config = model_and_config(recipe)
    target = replace(make_target(recipe, load_ds_config(ZERO3), 1, "cpu"), seq_len=128, loss="standard")
    assert target.lora is not None and 0 < target.trainable_params < target.all_params
    torch.manual_seed(0)
    model = fake_model(config, 4, target)  # real tensors (no fake mode): adapters added, base frozen
    assert sum(p.requires_grad for p in model.parameters()) == 4 * 7 * 2  # lora_A, lora_B on 7 linears per layer
    freeze(model)
    plan = plan_for(policy, 4, backend="torch")
    pred = planner.predict_run(recipe, load_ds_config(ZERO3), 1, plan, config, target)
    apply_plan(model, plan)
    ids = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    measured = allocator_peak(model, ids)
    assert pred.activation_peak == pytest.approx(measured, rel=0.05), (policy, pred.phase)


def test_fake_model_makes_the_adapters_on_the_weights_device(monkeypatch):
    """The profile's model with LoRA, tiled MLPs and the fused loss: every parameter and buffer on the fake device
    its base weights are on. On a GPU the profile fakes CUDA tensors; an adapter made on the CPU beside them
    stopped a LoRA run at start-up (H100, 2026-11-27). A CPU build cannot fake CUDA, so the meta device stands in
    for the fake device here: the adapters must follow it."""
    from dataclasses import replace

    import memtrain.memory.profile as profile

    recipe = load_recipe(None, ["model.lora.r=4", "activation_checkpointing.tiled_mlp=2"])
    config = model_and_config(recipe)
    target = replace(make_target(recipe, load_ds_config(ZERO3), 1, "cpu"), seq_len=64)
    assert target.lora is not None
    monkeypatch.setattr(profile, "_fake_device", lambda target: "meta")
    model = fake_model(config, 2, target)
    devices = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    assert sum(".lora_" in n for n, _ in model.named_parameters()) == 2 * 7 * 2
    assert devices == {"meta"}, devices


def test_zero12_accumulation_terms_by_phase(tiny):
    """Gradient accumulation 2 (make_target reads train.grad_accum_steps): ZeRO-2 holds one more gradient partition
    in a later micro-step's backward only; ZeRO-1 with overlap_comm holds every whole .grad between micro-steps
    (forward and backward), its reduce buckets too (no epilogue frees them), and the boundary's partition in the
    backward. The optimizer offloaded: ZeRO-2 accumulates in a host buffer, ZeRO-1 as without offload but for the
    partition (tests/launch/test_planner.py measures the peaks and the host bytes against real engines)."""
    from dataclasses import replace

    _, config, profile = tiny
    recipe = load_recipe(None, ["data.seq_len=128", "train.grad_accum_steps=2"])
    assert make_target(recipe, {}, 2, "cpu").grad_accum == 2
    one, two = Target("cpu", "float32", 1, 128, 2), Target("cpu", "float32", 1, 128, 2, grad_accum=2)
    t = profile.num_params
    for stage in (1, 2):
        ds = load_ds_config(str(ROOT / "ds_configs" / "zero2_ckpt.json"))
        ds["zero_optimization"]["stage"] = stage
        single, accum = model_states(profile, ds, one), model_states(profile, ds, two)
        partition = 4 * t // 2
        if stage == 2:
            assert accum.total == single.total and accum.backward == single.backward + partition
        else:
            assert accum.total == single.total + (4 * t - partition) + single.reduce_buckets
            assert accum.backward == single.backward - single.reduce_buckets + partition
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # the optimizer offloaded: ZeRO-2 accumulates in a host buffer, ZeRO-1 still in its whole .grads (and buckets)
        single, accum = model_states(profile, ds, one), model_states(profile, ds, two)
        if stage == 2:
            assert accum == replace(single, host=single.host + partition)
        else:
            assert accum.total == single.total + 4 * t + single.reduce_buckets and accum.host == single.host
            assert accum.backward == single.backward - single.reduce_buckets

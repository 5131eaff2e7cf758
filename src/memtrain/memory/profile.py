"""Activation costs measured on fake tensors: one decoder layer per AC mode, and what lies around the layers.

The real transformers model with one decoder layer runs one forward and backward per AC mode at the target
micro-batch, sequence length and dtype, on fake tensors (`FakeTensorMode`: shapes only, nothing allocated);
a 2-layer run separates the layer from what lies around it. A tracker follows every tensor storage through
the step (`memtrain.recompute.meter.StepTracker`), so the measurement covers any decoder family, attention
kernel, dtype and whatever the AC modes really keep.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Optional
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.recompute.policy import LAYER_MODES, ACPlan, ATTN, FULL, KEEP, MLP, custom_plan
from memtrain.recompute.compiled import CompiledLayers, partitioned_eager
from memtrain.recompute.hooks import apply_plan, remove_plan
from memtrain.recompute.units import find_sublayer
from memtrain.memory import profile_cache, tensor_parallel, ulysses
from memtrain.recompute.meter import ActivationMeter, CompiledCodeTracker, StepTracker
from memtrain.memory.target import Target
from memtrain.model.attention import plain
from memtrain.model.build import decoder_layers
from memtrain.model.freeze import freeze
from memtrain.model.lora import add_lora
from memtrain.model.loss import fused_backend, fused_unsupported, install_loss
from memtrain.model.quantize import quantized_layers
from memtrain.model.tiled_mlp import install_tiled_mlp, tiled_mlp_shards

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer under one AC mode, measured at the target shape."""

    saved: int  # bytes it keeps for backward at the end of the forward (ActivationMeter's measure)
    resident: int  # bytes its forward leaves alive on the device (saved + its output, less its input)
    fwd_excess: int  # transient peak above `resident`-so-far while it runs forward
    bwd_excess: int  # transient peak while it runs backward: the recompute working set for recomputed modes
    input_bytes: int  # its checkpointed input (what offload moves to the host)
    fwd_flops: float
    bwd_flops: float  # including any recompute
    bwd_written: float  # bytes its backward (and recompute) writes
    recompute_flops: float = 0.0  # extra backward FLOPs over keeping everything
    recompute_written: float = 0.0  # extra bytes written over keeping everything


@dataclass(frozen=True)
class ActivationProfile:
    """Measured activation costs of a model at one target shape; additive over layers."""

    target: Target
    num_layers: int
    num_params: int
    largest_layer_params: int
    param_sizes: tuple[tuple[int, int], ...]  # (elements, how many parameters of that size) over the model
    layers: dict[str, LayerCost]  # per AC mode
    outside_saved: int  # what embeddings, final norm, logits and loss keep for backward
    base: int  # alive before the first layer's forward (embeddings output, rotary tables)
    head_excess: int  # peak of logits, loss and their backward above everything saved
    head_net: int  # left alive after the head's backward (gradient of the last hidden states, ...)
    tail_excess: int  # peak after the first layer's backward (embedding backward)
    largest_block: int  # the largest single allocation of the step
    quantized_sizes: tuple[tuple[int, int], ...] = ()  # model.quantization: (elements, how many) of the 4-bit weights
    replicated: int = 0  # AutoTP (tp > 1): elements every TP rank holds whole (embeddings, norms): tensor_parallel
    # one decoder layer's parameters in the layer's order: (elements, replicated under AutoTP); ZeRO-3's reduction
    layer_params: tuple[tuple[int, bool], ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, micro_batch_size: int) -> "ActivationProfile":
        """Every activation carries the batch dimension, so sizes scale linearly with the micro-batch."""
        f = micro_batch_size / self.target.micro_batch_size
        sc = lambda v: int(round(v * f)) if isinstance(v, int) else v * f  # noqa: E731
        layers = {m: LayerCost(**{k: sc(v) for k, v in vars(c).items()}) for m, c in self.layers.items()}
        sizes = {k: sc(getattr(self, k)) for k in ("outside_saved", "base", "head_excess", "head_net",
                                                     "tail_excess", "largest_block")}
        return replace(self, target=replace(self.target, micro_batch_size=micro_batch_size), layers=layers, **sizes)


def supported_modes() -> tuple[str, ...]:
    """The per-layer AC modes memtrain.recompute implements ("keep", "full", and the selective ones)."""
    modes = LAYER_MODES
    return tuple(m for m in ("keep", "op", "attn", "mlp", "full") if m in modes)


def _layer_config(config, num_layers: int):
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):  # per-layer attention kinds (sliding, full)
        cfg.layer_types = cfg.layer_types[:num_layers]
    return cfg


def _layer_kinds(config) -> int:
    """How many kinds of decoder layer the model has (per-layer attention kinds: Gemma-2's sliding and full)."""
    types = getattr(config, "layer_types", None)
    return len(set(types)) if isinstance(types, list) and types else 1


def _param_shapes(model, num_layers: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """From a 1-layer model: (parameters of the num_layers model, the largest single module's,
    histogram of parameter sizes), tied parameters counted once."""
    unique = {id(p): p for p in model.parameters()}
    _, layers = decoder_layers(model)
    in_layer = {id(p) for p in layers[0].parameters()}
    sizes = Counter(p.numel() for k, p in unique.items() if k not in in_layer)
    for p in layers[0].parameters():
        sizes[p.numel()] += num_layers
    total = sum(numel * count for numel, count in sizes.items())
    largest = max(sum(p.numel() for p in m.parameters(recurse=m is layers[0])) for m in model.modules())
    return total, largest, tuple(sorted(sizes.items()))


def _quantized_shapes(model, num_layers: int) -> tuple[tuple[int, int], ...]:
    """From a 1-layer model: (elements, how many) of the weights a 4-bit base stores in 4 bits over the num_layers
    model (memtrain.model.quantize.quantized_layers)."""
    layer_path, _ = decoder_layers(model)
    sizes: Counter = Counter()
    for path in quantized_layers(model):
        inside = path.startswith(layer_path + ".0.")
        sizes[model.get_submodule(path).weight.numel()] += num_layers if inside else 1
    return tuple(sorted(sizes.items()))


MODULES = "modules:"  # a measured mode: "modules:mlp.act_fn|self_attn.q_proj", paths inside a layer


def modules_mode(paths) -> str:
    """The mode key of recomputing these modules (paths relative to a decoder layer) inside every layer."""
    return MODULES + "|".join(sorted(paths))


def mode_plan(model, modes) -> ACPlan:
    """The ACPlan a measured per-layer mode tuple stands for (modules modes: the same paths in every layer)."""
    if isinstance(modes, ACPlan):
        return modes
    path, _ = decoder_layers(model)
    layers, modules = [], []
    for i, mode in enumerate(modes):
        if mode.startswith(MODULES):
            layers.append(KEEP)
            modules += [f"{path}.{i}.{rel}" for rel in mode[len(MODULES):].split("|")]
        else:
            layers.append(mode)
    return custom_plan(layers, "torch", modules, policy="profile")


def _run(model, modes, target: Target, count_flops: bool = True, compiled: Optional[CompiledLayers] = None) -> dict:
    """One forward+backward under a per-layer plan (mode tuple or ACPlan): the live-bytes curve with
    per-layer marks (and FLOPs, unless `count_flops` is false: then every FLOP figure is 0). A compiled target's
    layers run through `compiled` (default: compiled afresh, `compiled_for_profile`)."""
    import memtrain.memory.flops  # noqa: F401, PLC0415 registers memtrain's FLOP formulas at import (transformers, torch._dynamo: seconds)

    _, layers = decoder_layers(model)
    plan = mode_plan(model, modes)
    apply_plan(model, plan, (compiled or compiled_for_profile(plan.op_save)) if target.compiled else None)
    block = CUDA_BLOCK if target.device == "cuda" else 1
    # a compiled run counts no FLOPs (its time terms are the eager layers': with_time_terms)
    tracker = CompiledCodeTracker(block) if target.compiled else StepTracker(block, count_flops)
    state = {"backward": False, "input_bytes": 0}
    handles = _mark_layers(layers, tracker, state)

    # A parameter's gradient lives from the op that makes it until autograd accumulates it into .grad; from
    # there on it is the model states' (ZeRO hands it to its reduce buckets): dropped at accumulation here.
    # Gradients made in the forward (the fused loss, torch's linear_cross_entropy, computes lm_head's full
    # weight gradient there and holds it through the backward) count as an activation-like transient too.
    handles += [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (target.micro_batch_size, target.seq_len), device=device)
    meter = ActivationMeter()
    try:
        with tracker:
            with meter.measure():
                loss = model(input_ids=ids, labels=ids).loss
            state["backward"] = True
            tracker.mark("backward")
            loss.backward()
            del loss
            tracker.mark("end")
    finally:
        for h in handles:
            h.remove()
        remove_plan(model)
    return {"curve": tracker.curve(), "marks": tracker.marks, "saved": meter.bytes,
            "input_bytes": state["input_bytes"], "largest_block": max((d for d, _ in tracker.events), default=0)}


def _mark_layers(layers, tracker, state: dict) -> list:
    """Marks: a layer's forward starts/ends with its module call; its backward starts when the gradient of its
    output is ready and ends when the gradient of its input is. `state` says whether the backward runs (a forward
    call then is a recompute, not marked) and keeps the last layer input's bytes. Returns the hooks' handles."""
    handles = []
    for k, layer in enumerate(layers):
        def pre(module, args, kwargs, k=k):
            if state["backward"]:  # a recompute, not the forward
                return
            tracker.mark(f"fwd_start{k}")
            x = args[0] if args else kwargs["hidden_states"]
            state["input_bytes"] = x.untyped_storage().nbytes()
            if x.requires_grad:
                x.register_hook(lambda g, k=k: tracker.mark(f"bwd_end{k}"))

        def post(module, args, kwargs, out, k=k):
            if state["backward"]:
                return
            tracker.mark(f"fwd_end{k}")
            y = out[0] if isinstance(out, (tuple, list)) else out
            y.register_hook(lambda g, k=k: tracker.mark(f"bwd_start{k}"))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


def compiled_for_profile(op_save: tuple[str, ...]) -> CompiledLayers:
    """Layers compiled as inductor partitions them, without code generation (`partitioned_eager`), under code objects of
    their own: one measurement's runs share its graphs, and dynamo's limit of recompiles per code object never makes
    a later measurement run eager."""
    return CompiledLayers(op_save, backend=partitioned_eager)


def fake_model(config, num_layers: int, target: Target):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 transformers: heavy, imported only when this runs

    # Everything the model is given (adapters, tiled MLPs, the loss) is made on the same fake device as its weights:
    # a fake CPU adapter beside a fake CUDA weight stops the profile (seen on an H100, 2026-11-27).
    with torch.device(_fake_device(target)):
        model = AutoModelForCausalLM.from_config(_layer_config(config, num_layers), dtype=target.torch_dtype)
        # the run's loss and tiled MLPs, so the profile measures what they keep. Under sequence
        # parallelism the profile is one rank's slice of tokens with all heads: the same bytes as
        # Ulysses' full sequence on heads/sp (its all-to-all buffers: memtrain.memory.ulysses).
        if target.lora is not None:  # the adapters' weights and what they keep; peft freezes the base weights
            add_lora(model, target.lora, dtype=target.torch_dtype)
            freeze(model)  # as the trainer: the frozen embedding's output requires grad (the first layer's backward)
        install_tiled_mlp(decoder_layers(model)[1],
                          tiled_mlp_shards(target.tiled_mlp, target.seq_len, config.hidden_size))
        install_loss(model, fused=target.loss == "fused" and not fused_unsupported(model, model.get_output_embeddings()))
    return model.train()


def _fake_device(target: Target) -> str:
    """Fake CUDA tensors need a CUDA build (checkpoint saves the device RNG); elsewhere fake CPU ones."""
    return "cuda" if target.device == "cuda" and torch.cuda.is_available() else "cpu"


@contextmanager
def packing(packed: bool):
    """Decide transformers' one data-dependent mask question as the real step does.

    Text rows have positions 0..S-1 in every row, so transformers finds no packed sequences and lets SDPA apply
    causality itself. Packed rows (data.format chat/instruction) restart their positions per sample, so sdpa and
    eager attention get a (micro-batch, 1, S, S) mask that keeps the samples apart (flash attention takes the
    positions instead and builds none). Fake tensors hold no values: the answer comes from the recipe's data
    here, and the mask, with what each layer's attention keeps of it, is measured like everything else.
    """
    from transformers import masking_utils  # noqa: PLC0415 transformers: heavy, imported only when this runs

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = (lambda position_ids: torch.zeros_like(position_ids)) if packed \
        else (lambda position_ids: None)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original




def profile_activations(config, target: Target, modes: Optional[tuple[str, ...]] = None,
                        count_flops: bool = True) -> ActivationProfile:
    """Measure one layer per AC mode, and the parts around the layers, on fake tensors (`_profiled`); or read
    the same measurement where it was kept (memtrain.memory.profile_cache: a run's preflight measured it).
    `count_flops=False`: memory only, every FLOP field 0 (torch's FLOP counter is about 40% of a measurement's time;
    `--max-seq` and predictions read no FLOPs); handed out from this process's counted measurement where there is one."""
    modes = tuple(modes or supported_modes())
    if profile_cache.kept_in() is None:
        return _profiled(config, target, modes, count_flops)
    name = profile_cache.key(config.to_json_string(), {**target.to_dict(), "loss": _loss_code(target),
                                                       "flops": count_flops}, modes)
    if name not in _KEPT:
        _KEPT[name] = profile_cache.kept_or_measured(
            name, lambda: _read_kept(name, target), lambda: _profiled(config, target, modes, count_flops),
            lambda kept: {**kept.to_dict(), "target": None})  # the target is the key's, not kept
    return _KEPT[name]


def _read_kept(name: str, target: Target) -> Optional[ActivationProfile]:
    """The kept profile, or None where there is none or it does not make a profile (measured again)."""
    kept = profile_cache.read(name)
    try:
        return None if kept is None else from_dict(kept, target)
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def from_dict(d: dict, target: Target) -> ActivationProfile:
    """A profile from its `to_dict()` (JSON: lists for tuples), measured at `target`."""
    pairs = lambda v: tuple(tuple(p) for p in v)  # noqa: E731
    return ActivationProfile(**{**d, "target": target, "layers": {m: LayerCost(**c) for m, c in d["layers"].items()},
                                "param_sizes": pairs(d["param_sizes"]), "quantized_sizes": pairs(d["quantized_sizes"]),
                                "layer_params": pairs(d.get("layer_params", ()))})


def forget_measured() -> None:
    """Drop this process's profiles (kept on disk ones stay): the next call measures or reads again."""
    for memo in (_PROFILES, _MODE_COSTS, _KEPT):
        memo.clear()


def _profiled(config, target: Target, modes: tuple[str, ...], count_flops: bool = True) -> ActivationProfile:
    """Measure one layer per AC mode, and the parts around the layers, on fake tensors.

    A 1-layer model runs once per mode: its layer's window of the live-bytes curve gives what the
    layer leaves alive, its transient peaks and its FLOPs. A 2-layer model without recompute runs
    once more: the difference in saved bytes is one kept layer, which separates what the layer
    saves from what embeddings, final norm, logits and loss save (the same in every mode; with tiled MLPs
    both keep runs of that difference run untiled, `_keep_pair`).
    Modes may include `modules_mode(paths)`: those modules inside the layer recomputed.
    """
    if KEEP not in modes:
        modes = (KEEP, *modes)
    extra = tuple(m for m in modes if m.startswith(MODULES))
    modes = tuple(m for m in modes if m not in extra)
    full_config, config = config, tensor_parallel.local_config(config, target.tp)  # one TP rank's shards
    key = (config.to_json_string(), measured_part(target), _loss_code(target), modes, count_flops)
    if key not in _PROFILES and not count_flops and (*key[:-1], True) in _PROFILES:
        _PROFILES[key] = _without_flops(_PROFILES[(*key[:-1], True)])  # the counted run measured the same bytes
    if key not in _PROFILES:
        measured = _measure_profile(config, target, modes, count_flops)
        if target.compiled and count_flops:  # the eager layers' time terms: that profile, measured once
            measured = with_time_terms(measured, _profiled(full_config, replace(target, compiled=False), modes))
        measured = tensor_parallel.shard_lm_head(measured, full_config, target.tp)
        measured = tensor_parallel.mark_replicated(measured, full_config, target.tp)
        measured = ulysses.add_buffers(measured, config)  # its all-to-all buffers (sp > 1)
        _PROFILES[key] = tensor_parallel.partition_inputs(measured, target.tp) if target.partition else measured
    profile = _PROFILES[key]
    if profile.target != target:  # measured for another world size or accumulation: the same bytes, this target
        profile = replace(profile, target=target)
    if not extra:
        return profile
    layers = dict(profile.layers)
    mkey = (config.to_json_string(), measured_part(target), _loss_code(target), count_flops)
    for mode in extra:
        counted = (*mkey[:-1], True, mode)
        if (*mkey, mode) not in _MODE_COSTS and not count_flops and counted in _MODE_COSTS:
            _MODE_COSTS[(*mkey, mode)] = (_no_flops(_MODE_COSTS[counted][0]), _MODE_COSTS[counted][1])
        if (*mkey, mode) not in _MODE_COSTS:
            with FakeTensorMode(allow_non_fake_inputs=True), packing(target.packed), plain():
                run = _run(fake_model(config, 1, target), (mode,), target, count_flops)
            _MODE_COSTS[(*mkey, mode)] = (_layer_cost(run, profile.outside_saved, profile.layers[KEEP]),
                                          run["largest_block"])
        layers[mode] = _MODE_COSTS[(*mkey, mode)][0]
    largest = max([profile.largest_block] + [_MODE_COSTS[(*mkey, m)][1] for m in extra])
    return replace(profile, layers=layers, largest_block=largest)


def _no_flops(cost: LayerCost) -> LayerCost:
    """A layer's cost as a memory-only measurement gives it: every FLOP field 0."""
    return replace(cost, fwd_flops=0, bwd_flops=0, recompute_flops=0.0)


def _without_flops(profile: ActivationProfile) -> ActivationProfile:
    """A FLOP-counted profile as a memory-only measurement of it gives it (the counter changes no byte)."""
    return replace(profile, layers={m: _no_flops(c) for m, c in profile.layers.items()})


def measured_part(target: Target) -> Target:
    """`target` with what no measurement reads set to one value: the world size, the trained share of the parameters
    and the accumulation steps (the model states' and the step's, not one layer's activations). Profiles of two
    targets that differ only there are one measurement."""
    return replace(target, world_size=1, trainable_params=0, all_params=0, grad_accum=1)


def _loss_code(target: Target) -> str:
    """The loss a measurement runs, with the fused loss's backend (torch's or memtrain's chunked: their working sets
    differ): part of every memo key, so a profile of one backend is never handed out for the other."""
    return f"fused:{fused_backend()}" if target.loss == "fused" else target.loss


_PROFILES: dict[tuple, "ActivationProfile"] = {}  # deterministic: measure once per process
_MODE_COSTS: dict[tuple, tuple["LayerCost", int]] = {}  # modules modes, measured on demand
_KEPT: dict[str, "ActivationProfile"] = {}  # by profile_cache key: read or measured once per process


def _live(run, mark):
    return run["curve"][run["marks"][mark][0]]


def _peak(run, start, stop):
    return max(run["curve"][run["marks"][start][0]:run["marks"][stop][0] + 1])


def _delta(run, start, stop, what):  # FLOPs (1) or bytes written (2) between two marks
    return run["marks"][stop][what] - run["marks"][start][what]


def _layer_cost(run, outside_saved: int, keep: Optional[LayerCost] = None) -> LayerCost:
    """Layer 0's costs from a 1-layer run; with `keep`, its extra over keeping everything as well."""
    cost = LayerCost(
        saved=run["saved"] - outside_saved,
        resident=_live(run, "fwd_end0") - _live(run, "fwd_start0"),
        fwd_excess=_peak(run, "fwd_start0", "fwd_end0") - _live(run, "fwd_start0"),
        bwd_excess=_peak(run, "bwd_start0", "bwd_end0") - _live(run, "bwd_start0"),
        input_bytes=run["input_bytes"],
        fwd_flops=_delta(run, "fwd_start0", "fwd_end0", 1),
        bwd_flops=_delta(run, "bwd_start0", "bwd_end0", 1),
        bwd_written=_delta(run, "bwd_start0", "bwd_end0", 2),
    )
    if keep is None:
        return cost
    return replace(cost, recompute_flops=max(0.0, cost.bwd_flops - keep.bwd_flops),
                   recompute_written=max(0.0, cost.bwd_written - keep.bwd_written))


TIME_TERMS = ("fwd_flops", "bwd_flops", "bwd_written", "recompute_flops", "recompute_written")


def with_time_terms(compiled: ActivationProfile, eager: ActivationProfile) -> ActivationProfile:
    """A compiled layers' profile (`train.compile`) with the eager layers' FLOPs and bytes written: compiling moves no
    matmul or attention (the FLOPs counted), and the step-time rates are fitted to eager layers. Its bytes are the
    compiled layers' own."""
    layers = {m: replace(c, **{k: getattr(eager.layers[m], k) for k in TIME_TERMS}) for m, c in compiled.layers.items()}
    return replace(compiled, layers=layers)


def _keep_pair(config, target: Target, keep_run: dict, count_flops: bool, compiled) -> tuple[dict, dict, bool]:
    """The 1- and 2-layer keep runs whose saved bytes differ by one kept layer (`outside_saved`), and whether they ran
    without the target's tiled MLPs. Tiling changes nothing outside the layers: over the 18 families of
    tests/families.py (standard and fused loss, 512 tokens, `auto` slices) untiled runs gave the same outside_saved
    (2026-11-27), and a tiled 2-layer run dispatches two layers' slices on fake tensors (most of a long-sequence
    profile's time). So an eager tiled target's pair runs untiled; its largest block is the tiled runs' alone."""
    shards = tiled_mlp_shards(target.tiled_mlp, target.seq_len, config.hidden_size)
    if target.compiled or shards <= 1:
        return keep_run, _run(fake_model(config, 2, target), (KEEP, KEEP), target, count_flops, compiled), False
    plain_mlps = replace(target, tiled_mlp=0)
    one = _run(fake_model(config, 1, plain_mlps), (KEEP,), plain_mlps, False)
    return one, _run(fake_model(config, 2, plain_mlps), (KEEP, KEEP), plain_mlps, False), True


def _measure_profile(config, target: Target, modes: tuple[str, ...], count_flops: bool = True) -> ActivationProfile:
    """See `_profiled`. A compiled target (`train.compile`) runs each layer as torch.compile partitions it (forward and
    backward graphs as inductor splits them, run eagerly: memtrain.recompute.compiled.partitioned_eager)."""
    runs: dict[str, dict] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), packing(target.packed), plain():
        model = fake_model(config, 1, target)
        compiled = compiled_for_profile(mode_plan(model, (KEEP,)).op_save) if target.compiled else None
        num_params, largest, param_sizes = _param_shapes(model, config.num_hidden_layers)
        quantized = _quantized_shapes(model, config.num_hidden_layers) if target.quantization is not None else ()
        layer = decoder_layers(model)[1][0]  # sublayer modes only where the layer has the sublayer (not OPT's MLP)
        modes = tuple(m for m in modes if m not in (ATTN, MLP) or find_sublayer(layer, m) is not None)
        for mode in modes:
            runs[mode] = _run(model, (mode,), target, count_flops, compiled)
        one_keep, two_keep, untiled = _keep_pair(config, target, runs[KEEP], count_flops, compiled)
        deeper = [_run(fake_model(config, 2, target), (FULL, FULL), target, count_flops, compiled)] \
            if FULL in modes and _layer_kinds(config) > 1 else []
    outside_saved = 2 * one_keep["saved"] - two_keep["saved"]
    keep = _layer_cost(runs[KEEP], outside_saved)
    layers = {mode: _layer_cost(run, outside_saved, keep) for mode, run in runs.items()}
    run = runs[KEEP]  # the parts around the layers do not depend on the layers' mode
    # ... but on which layer kinds the model has, and on what the last layer keeps of its output: what the head
    # leaves alive for the backward (`head_net`) is the largest over the modes, and over 2-layer runs, whose
    # layers hold what every layer kind needs (Gemma-2 alternates sliding-window and full-attention layers:
    # a 1-layer model frees the full mask after its forward, a deeper one recomputed keeps it for the recompute).
    # With one layer kind the recomputed 2-layer run adds nothing: over the 18 families of tests/families.py on
    # fake CPU fp32 and CUDA bf16 (standard and fused loss), its head_net and largest block equal the 1-layer
    # runs' in every case but Gemma-2's (2026-11-27); it is a third of a profile's time.
    head_net = max([_live(r, "bwd_start0") - _live(r, "fwd_end0") for r in runs.values()]
                   + [_live(r, "bwd_start1") - _live(r, "fwd_end1") for r in (two_keep, *deeper)])
    return ActivationProfile(
        target=target,
        num_layers=config.num_hidden_layers,
        num_params=num_params,
        largest_layer_params=largest,
        param_sizes=param_sizes,
        layers=layers,
        outside_saved=outside_saved,
        base=_live(run, "fwd_start0"),
        head_excess=_peak(run, "fwd_end0", "bwd_start0") - _live(run, "fwd_end0"),
        head_net=head_net,
        tail_excess=_peak(run, "bwd_end0", "end") - _live(run, "bwd_end0"),
        largest_block=max(r["largest_block"] for r in (*runs.values(), *deeper, *(() if untiled else (two_keep,)))),
        quantized_sizes=quantized,
        layer_params=tuple((p.numel(), False) for p in layer.parameters()),
    )



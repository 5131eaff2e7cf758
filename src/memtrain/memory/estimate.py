"""Memory model: a training step's peak device memory, predicted before the run.

    peak = model states (parameters, gradients, optimizer states: ZeRO stage, offload, world size)
         + activations (saved per layer, the recompute working set, logits and loss buffers)
         + the allocator's margin

Activation sizes are measured, not derived from formulas: the real transformers model with one
decoder layer runs one forward and backward per AC mode at the target micro-batch, sequence
length and dtype, on fake tensors (`FakeTensorMode`: shapes only, nothing allocated); a 2-layer
run separates the layer from what lies around it. A tracker follows every tensor storage through
the step (`memtrain.memory.tracker.StepTracker`), so the measurement covers any decoder family, attention kernel, dtype
and whatever the AC modes really keep. The layer count scales it: the live bytes at any point
are prefix sums of per-layer costs (`activation_peak`), which tests check against real steps.

Any ACPlan maps onto it (`predict_plan`, memtrain.memory.planner.predict_run): per-layer modes, sqrt
segments (one unit of k full layers: one layer's resident bytes, a k-layer recompute working
set), modules patterns (matched sublayers as their modes, anything else inside a layer measured
as a mode of its own; matches outside the layers are named in `Prediction.notes`), memtrain's
offload (PREFETCH_DEPTH restored inputs ahead during the backward; on CUDA the side-stream copy
holding an input through the next forward), ZeRO-1/2 reduce buckets (backward only), and the
allocator margin (ALLOCATOR_MARGIN, measured on an H100: see there).
"""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from memtrain.recompute.policy import LAYER_MODES, ACPlan, ATTN, FULL, KEEP, MLP, OP
from memtrain.recompute.hooks import _pattern, _sublayer, apply_plan, find_sublayer, remove_plan
from memtrain.config.ds_config import AUTO
from memtrain.config.recipe import LoraSection
from memtrain.config.recompute_spec import RecomputeSpec, resolve_recompute
from memtrain.config.zero3 import resident
from memtrain.memory import tensor_parallel
from memtrain.memory.tracker import ActivationMeter, StepTracker

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes

# Allocator margin on CUDA: what torch.cuda.max_memory_allocated() shows above the live tensors
# this model adds up (block rounding is already in the measured sizes; this is what is left:
# allocations that briefly overlap, kernels' workspaces). Measured, `make gpu-check` on one H100
# 80GB HBM3 (llama-1b, seq 2048, micro-batch 8, bf16, ZeRO-3, torch 2.11): with a margin of one
# largest allocation (the 1.95 GiB fp32 logits) the prediction was over the measured peak by
# +3.4 GiB (none), +2.1 (full, either backend), +2.1 (op), +1.3 (full + offload); without it by
# +1.47, +0.10, +0.10 and -0.70 GiB (+2.8%, +0.4%, +0.3%, -3.0%). So the measured margin of
# max_memory_allocated is none: 0. Fragmentation shows in max_memory_reserved, not here; keep
# headroom for it in the budget itself.
ALLOCATOR_MARGIN = 0.0  # times the step's largest single allocation (measured, see above)
ALLOCATOR_MARGIN_BYTES = 0  # fixed bytes on top (measured, see above)


# --------------------------------------------------------------------------- target

@dataclass(frozen=True)
class Target:
    """What the prediction is for: one device of a run."""

    device: str  # "cuda" or "cpu"
    dtype: str  # compute dtype of activations: "float32" | "bfloat16" | "float16"
    micro_batch_size: int
    seq_len: int  # tokens one rank holds: the sequence over the sequence-parallel size
    world_size: int
    loss: str = "standard"  # train.loss: fused | standard (memtrain.model.loss)
    tiled_mlp: object = 0  # activation_checkpointing.tiled_mlp: slices, or "auto"
    sequence_parallel: int = 1  # parallel.sequence (seq_len is already per rank)
    tp: int = 1  # tensor-parallel size (AutoTP): one rank holds the local shards (memtrain.memory.tensor_parallel)
    partition: bool = False  # checkpointed inputs partitioned across the TP group (DeepSpeed backend)
    trainable_params: int = 0  # train.trainable / train.frozen: elements that train (0: every parameter) ...
    all_params: int = 0  # ... of this many (memtrain.model.freeze); gradients and optimizer states scale by the ratio
    lora: Optional[LoraSection] = None  # model.lora: the measured layers carry the adapters (memtrain.model.lora)

    def trained(self, n: int) -> int:
        """Of `n` parameter elements (the whole model, or one TP rank's shards), those that train."""
        if not (self.trainable_params and self.all_params):
            return n
        return n if self.trainable_params == self.all_params else round(n * self.trainable_params / self.all_params)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def compute_dtype(ds_config: dict, device: str) -> str:
    """The dtype DeepSpeed computes in. bf16 "auto" means on where supported: a GPU here."""
    def enabled(key):
        value = (ds_config.get(key) or {}).get("enabled", False)
        if value != AUTO:
            return bool(value)
        if device == "cuda" and torch.cuda.is_available():
            return key == "bf16" and torch.cuda.is_bf16_supported()  # as resolve_ds_config fills it
        return device == "cuda" and key == "bf16"  # planning for a GPU from a host without one

    if enabled("bf16"):
        return "bfloat16"
    if enabled("fp16"):
        return "float16"
    return "float32"


def recompute_spec(recipe, ds_config: dict, device: Optional[str] = None) -> RecomputeSpec:
    """The RecomputeSpec of a run of `recipe` under `ds_config` on `device` (default: this machine's), for a
    tool that plans without running (make plan, max_seq, an OOM report); a run resolves its own in preflight."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_recompute(ds_config, recipe.activation_checkpointing, device)


def make_target(recipe, ds_config: dict, world_size: int, device: Optional[str] = None,
                spec: Optional[RecomputeSpec] = None) -> Target:
    """The run to predict: `spec` (default: resolved for `device`) says whether checkpointed inputs are
    partitioned across the tensor-parallel group."""
    device = device or (spec.device if spec else ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = spec or recompute_spec(recipe, ds_config, device)
    sp = recipe.parallel.sequence
    tp = spec.tp_size
    trainable, total = _trainable(recipe)
    return Target(device, compute_dtype(ds_config, device), recipe.train.micro_batch_size,
                  max(recipe.data.seq_len // sp, 1), world_size,
                  loss=recipe.train.loss if tp <= 1 else "standard",  # AutoTP: memtrain.train.long_context
                  tiled_mlp=recipe.activation_checkpointing.tiled_mlp, sequence_parallel=sp, tp=tp,
                  partition=spec.partition_activations, trainable_params=trainable, all_params=total,
                  lora=recipe.model.lora)


def _trainable(recipe) -> tuple[int, int]:
    """(elements that train, elements in all) under the recipe's train.trainable / train.frozen, counted on the
    meta model; (0, 0) when every parameter trains."""
    t = recipe.train
    if not (t.trainable or t.frozen or recipe.model.lora):
        return 0, 0
    from memtrain.model.build import build_on_meta
    from memtrain.model.freeze import count_trainable

    model = build_on_meta(recipe.model, model_and_config(recipe))
    if recipe.model.lora is not None:
        from memtrain.model.lora import add_lora

        add_lora(model, recipe.model.lora)
    return count_trainable(model, t.trainable, t.frozen), sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- model states

@dataclass(frozen=True)
class ModelStates:
    """Bytes per device for parameters, gradients and optimizer states, and what sits on the host."""

    params: int  # this rank's parameters (its partition under ZeRO-3)
    grads: int
    optimizer: int  # fp32 master copy and Adam's two moments
    buckets: int  # ZeRO-3's contiguous reduce bucket (allocated in full, whatever the model size)
    persistent: int  # ZeRO-3: parameters below the persistence threshold, also kept whole on every rank
    gathered: int  # ZeRO-3: the module being computed and the prefetch bucket, gathered in full
    update: int  # fp32 gradients made for the update (mixed precision); only during the step, with no activations
    host: int  # offloaded to host memory (not part of the device peak)
    reduce_buckets: int = 0  # ZeRO-1/2 ipg reduce buckets: live from the first gradient to the end of the backward
    reduce_scratch: int = 0  # ZeRO-1/2: the flattened copy of one bucket while it is reduced (backward only)

    @property
    def backward(self) -> int:
        """What exists only while gradients are reduced (the backward), not in the forward or the update."""
        return self.reduce_buckets + self.reduce_scratch

    @property
    def total(self) -> int:
        """What is on the device through the forward and backward."""
        return self.params + self.grads + self.optimizer + self.buckets + self.persistent + self.gathered


def model_states(profile: "ActivationProfile", ds_config: dict, target: Target) -> ModelStates:
    """DeepSpeed's layout, component by component, with DeepSpeed's own defaults for its JSON.

    c = compute bytes per parameter (2 in bf16/fp16, 4 in fp32). Adam keeps two fp32 moments (8)
    beside an fp32 master copy (4; stages 1-3 keep one in fp32 training too, as measured on CPU).
    Stage >= 1 shards the optimizer, >= 2 the gradients, 3 the parameters.

    ZeRO-1/2 (DeepSpeedZeroOptimizer.setup_buckets, at the first gradient hook of a backward, freed
    in its epilogue): with contiguous_gradients one ipg bucket of reduce_bucket_size elements per
    communication dtype, two with overlap_comm (double buffering); with more than one rank,
    reducing a bucket flattens its per-rank slices into one more tensor of up to the bucket's size
    (allreduce_and_scatter -> allreduce_bucket; in a world of one the slices merge into one and the
    flatten is a view: measured, nothing allocated); both in the
    compute dtype (DeepSpeed's default grad_accum_dtype). allgather_bucket_size allocates
    nothing: the parameters' all-gather writes into the flat parameter buffer
    (all_gather_into_tensor_dp_groups; the bucketed fallback gathers into narrowed views of it).
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))
    # ZeRO shards over the data-parallel ranks; with TP, profile.num_params is already one rank's shard
    n, world, stage = profile.num_params, max(target.world_size // target.tp, 1), int(zero.stage)
    t = target.trained(n)  # frozen parameters (memtrain.model.freeze) have no gradient and no optimizer state
    c = torch.tensor([], dtype=target.torch_dtype).element_size()
    offloaded = lambda o: o is not None and str(getattr(o.device, "value", o.device)) in ("cpu", "nvme")  # noqa: E731
    offload_opt = stage >= 1 and offloaded(zero.offload_optimizer)
    offload_param = stage == 3 and offloaded(zero.offload_param)
    mixed = c < 4
    master = 4 if (stage >= 1 or mixed) else 0

    params = c * n // (world if stage == 3 else 1)
    # ZeRO-1 with overlap_comm reduces in the gradient hooks as ZeRO-2 does, freeing each .grad once
    # it is in a bucket: only this rank's partition stays (measured, DeepSpeed 0.19.8, 2 ranks)
    grads = c * t // (world if stage >= 2 or (stage == 1 and zero.overlap_comm) else 1)
    optimizer = (master + 8) * t // (world if stage >= 1 else 1)
    update = 4 * t // (world if stage >= 1 else 1) if mixed else 0
    buckets = persistent = gathered = 0
    if stage == 3:
        buckets = c * zero.reduce_bucket_size if zero.contiguous_gradients else 0
        small = sum(numel * count for numel, count in profile.param_sizes
                    if numel <= zero.param_persistence_threshold)
        persistent = c * small if world > 1 else 0  # in a world of one the partition is the parameter (measured)
        # the unit ZeRO-3 gathers at once is a whole decoder layer (memtrain.config.zero3 makes layers leaf
        # modules), plus the prefetch bucket
        gathered = c * (profile.largest_layer_params + min(zero.prefetch_bucket_size, n))
        if resident(ds_config, world):  # memtrain.config.zero3: every parameter persists, nothing is gathered
            gathered = 0
        elif world > 1 and zero.max_reuse_distance >= 2 * n:
            # DeepSpeed releases a gathered parameter only if no use of it lies within
            # max_reuse_distance elements of the trace (forward and backward: ~2n); within reach, every
            # non-persistent parameter stays whole from its forward to its backward (measured, 2 ranks,
            # DeepSpeed 0.19.8). In a world of one the H100 calibration above holds (not re-measured).
            gathered = max(gathered, c * (n - small))
    reduce_buckets = reduce_scratch = 0
    if stage in (1, 2):
        g = c  # the gradient dtype (data_types.grad_accum_dtype apart from it is not modelled)
        if zero.contiguous_gradients or offload_opt:  # DeepSpeed turns contiguous gradients on for offload
            reduce_buckets = g * int(zero.reduce_bucket_size) * (2 if zero.overlap_comm else 1)
        if world > 1:  # in a world of one a bucket's slices merge into one view: nothing is copied
            largest_param = max((numel for numel, _ in profile.param_sizes), default=0)
            reduce_scratch = g * min(n, max(int(zero.reduce_bucket_size), largest_param))
    host = 0
    if offload_opt:
        # The update runs on the host (measured, DeepSpeed 0.19.8, 2 ranks): the fp32 master and
        # Adam's moments, the fp32 gradient partition it steps with (in fp32 training too), and a
        # compute-dtype partition: ZeRO-1/2's bit16 buffer the update is copied back through, ZeRO-3's
        # gradient partitions (on the offload device). ZeRO-1/2 stage each gradient through a buffer
        # of the largest parameter's size on the device and one on the host.
        host += optimizer + 4 * t // world + c * t // world
        optimizer = update = 0
        if stage == 3:
            grads = 0
        else:  # ZeRO-1 without overlap_comm keeps its full .grad until the backward's end (not measured)
            largest_param = max((numel for numel, _ in profile.param_sizes), default=0)
            grads = (grads if stage == 1 and not zero.overlap_comm else 0) + c * largest_param
            host += c * largest_param
    if offload_param:
        host += params
        params = 0
    return ModelStates(params, grads, optimizer, buckets, persistent, gathered, update, host,
                       reduce_buckets, reduce_scratch)


# --------------------------------------------------------------------------- measurement

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

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, micro_batch_size: int) -> "ActivationProfile":
        """Every activation carries the batch dimension, so sizes scale linearly with the micro-batch."""
        f = micro_batch_size / self.target.micro_batch_size
        sc = lambda v: int(round(v * f)) if isinstance(v, int) else v * f  # noqa: E731
        layers = {m: LayerCost(**{k: sc(v) for k, v in asdict(c).items()}) for m, c in self.layers.items()}
        fields = {k: sc(getattr(self, k)) for k in ("outside_saved", "base", "head_excess", "head_net",
                                                      "tail_excess", "largest_block")}
        target = Target(**{**asdict(self.target), "micro_batch_size": micro_batch_size})
        return replace(self, target=target, layers=layers, **fields)


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


def _param_shapes(model, num_layers: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """From a 1-layer model: (parameters of the num_layers model, the largest single module's,
    histogram of parameter sizes), tied parameters counted once."""
    from collections import Counter

    from memtrain.model.build import decoder_layers

    unique = {id(p): p for p in model.parameters()}
    _, layers = decoder_layers(model)
    in_layer = {id(p) for p in layers[0].parameters()}
    sizes = Counter(p.numel() for k, p in unique.items() if k not in in_layer)
    for p in layers[0].parameters():
        sizes[p.numel()] += num_layers
    total = sum(numel * count for numel, count in sizes.items())
    largest = max(sum(p.numel() for p in m.parameters(recurse=m is layers[0])) for m in model.modules())
    return total, largest, tuple(sorted(sizes.items()))


MODULES = "modules:"  # a measured mode: "modules:mlp.act_fn|self_attn.q_proj", paths inside a layer


def modules_mode(paths) -> str:
    """The mode key of recomputing these modules (paths relative to a decoder layer) inside every layer."""
    return MODULES + "|".join(sorted(paths))


def _mode_plan(model, modes) -> ACPlan:
    """The ACPlan a measured per-layer mode tuple stands for (modules modes: the same paths in every layer)."""
    from memtrain.model.build import decoder_layers

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
    return ACPlan(policy="profile", layers=tuple(layers), backend="torch", modules=tuple(modules))


def _run(model, modes, target: Target) -> dict:
    """One forward+backward under a per-layer plan (mode tuple or ACPlan): the live-bytes curve with
    per-layer marks."""
    from memtrain.model.flops import flop_counter
    from memtrain.model.build import decoder_layers

    _, layers = decoder_layers(model)
    apply_plan(model, _mode_plan(model, modes))
    counter = flop_counter()
    tracker = StepTracker(counter.get_total_flops, CUDA_BLOCK if target.device == "cuda" else 1)
    state = {"backward": False, "input_bytes": 0}
    handles = []

    # Marks: a layer's forward starts/ends with its module call; its backward starts when the
    # gradient of its output is ready and ends when the gradient of its input is.
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

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (target.micro_batch_size, target.seq_len), device=device)
    meter = ActivationMeter()
    try:
        with counter, tracker:
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
    # Parameter gradients count with the model states, except a gradient made in the forward: the
    # fused loss (torch's linear_cross_entropy) computes lm_head's full weight gradient there and
    # holds it through the backward, an activation-like transient the model states do not hold.
    backward_start = tracker.marks["backward"][0]
    grads = {serial for p in model.parameters() if p.grad is not None
             for serial in [tracker.serial(p.grad.untyped_storage())] if serial is None or serial >= backward_start}
    for p in model.parameters():
        p.grad = None
    return {"curve": tracker.curve(grads), "marks": tracker.marks, "saved": meter.bytes,
            "input_bytes": state["input_bytes"],
            "largest_block": max((d for d, s in tracker.events if s not in grads), default=0)}


def _fake_model(config, num_layers: int, target: Target):
    from transformers import AutoModelForCausalLM

    from memtrain.model.build import decoder_layers
    from memtrain.model.loss import fused_unsupported, install_loss
    from memtrain.model.tiled_mlp import install_tiled_mlp, tiled_mlp_shards

    with torch.device(_fake_device(target)):
        model = AutoModelForCausalLM.from_config(_layer_config(config, num_layers), dtype=target.torch_dtype)
    # the run's loss and tiled MLPs, so the profile measures what they keep. Under sequence
    # parallelism the profile is one rank's slice of tokens with all heads: the same bytes as
    # Ulysses' full sequence on heads/sp (its all-to-all buffers are not modelled).
    if target.lora is not None:  # the adapters' weights and what they keep; peft freezes the base weights
        from memtrain.model.freeze import freeze
        from memtrain.model.lora import add_lora

        add_lora(model, target.lora, dtype=target.torch_dtype)
        freeze(model)  # as the trainer: the frozen embedding's output requires grad (the first layer's backward)
    install_tiled_mlp(decoder_layers(model)[1], tiled_mlp_shards(target.tiled_mlp, target.seq_len, config.hidden_size))
    install_loss(model, fused=target.loss == "fused" and not fused_unsupported(model, model.get_output_embeddings()))
    return model.train()


def _fake_device(target: Target) -> str:
    """Fake CUDA tensors need a CUDA build (checkpoint saves the device RNG); elsewhere fake CPU ones."""
    return "cuda" if target.device == "cuda" and torch.cuda.is_available() else "cpu"


@contextmanager
def _no_packed_sequences():
    """Decide transformers' one data-dependent mask question as the real step does.

    memtrain passes no attention mask and positions 0..S-1 in every row, so transformers finds no
    packed sequences and lets SDPA apply causality itself. Fake tensors hold no values, so it would
    assume packing and build a (batch, 1, S, S) mask the real step never has.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def profile_activations(config, target: Target, modes: Optional[tuple[str, ...]] = None) -> ActivationProfile:
    """Measure one layer per AC mode, and the parts around the layers, on fake tensors.

    A 1-layer model runs once per mode: its layer's window of the live-bytes curve gives what the
    layer leaves alive, its transient peaks and its FLOPs. A 2-layer model without recompute runs
    once more: the difference in saved bytes is one kept layer, which separates what the layer
    saves from what embeddings, final norm, logits and loss save (the same in every mode).
    Modes may include `modules_mode(paths)`: those modules inside the layer recomputed.
    """
    modes = tuple(modes or supported_modes())
    if KEEP not in modes:
        modes = (KEEP, *modes)
    extra = tuple(m for m in modes if m.startswith(MODULES))
    modes = tuple(m for m in modes if m not in extra)
    full_config, config = config, tensor_parallel.local_config(config, target.tp)  # one TP rank's shards
    key = (config.to_json_string(), target, modes)
    if key not in _PROFILES:
        measured = _measure_profile(config, target, modes)
        measured = tensor_parallel.shard_lm_head(measured, full_config, target.tp)
        _PROFILES[key] = tensor_parallel.partition_inputs(measured, target.tp) if target.partition else measured
    profile = _PROFILES[key]
    if not extra:
        return profile
    layers = dict(profile.layers)
    for mode in extra:
        mkey = (config.to_json_string(), target, mode)
        if mkey not in _MODE_COSTS:
            from torch._subclasses.fake_tensor import FakeTensorMode

            from memtrain.model.attention import plain

            with FakeTensorMode(allow_non_fake_inputs=True), _no_packed_sequences(), plain():
                run = _run(_fake_model(config, 1, target), (mode,), target)
            _MODE_COSTS[mkey] = (_layer_cost(run, profile.outside_saved, profile.layers[KEEP]),
                                 run["largest_block"])
        layers[mode] = _MODE_COSTS[mkey][0]
    largest = max([profile.largest_block] + [_MODE_COSTS[(config.to_json_string(), target, m)][1] for m in extra])
    return replace(profile, layers=layers, largest_block=largest)


_PROFILES: dict[tuple, "ActivationProfile"] = {}  # deterministic: measure once per process
_MODE_COSTS: dict[tuple, tuple["LayerCost", int]] = {}  # modules modes, measured on demand


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


def _measure_profile(config, target: Target, modes: tuple[str, ...]) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtrain.model.attention import plain
    from memtrain.model.build import decoder_layers

    runs: dict[str, dict] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), _no_packed_sequences(), plain():
        model = _fake_model(config, 1, target)
        num_params, largest, param_sizes = _param_shapes(model, config.num_hidden_layers)
        layer = decoder_layers(model)[1][0]  # sublayer modes only where the layer has the sublayer (not OPT's MLP)
        modes = tuple(m for m in modes if m not in (ATTN, MLP) or find_sublayer(layer, m) is not None)
        for mode in modes:
            runs[mode] = _run(model, (mode,), target)
        two_keep = _run(_fake_model(config, 2, target), (KEEP, KEEP), target)
    outside_saved = 2 * runs[KEEP]["saved"] - two_keep["saved"]
    keep = _layer_cost(runs[KEEP], outside_saved)
    layers = {mode: _layer_cost(run, outside_saved, keep) for mode, run in runs.items()}
    run = runs[KEEP]  # the parts around the layers do not depend on the layers' mode
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
        head_net=_live(run, "bwd_start0") - _live(run, "fwd_end0"),
        tail_excess=_peak(run, "bwd_end0", "end") - _live(run, "bwd_end0"),
        largest_block=max(r["largest_block"] for r in (*runs.values(), two_keep)),
    )


def model_and_config(recipe, seq_len: Optional[int] = None):
    """The transformers config the trainer builds for this recipe (tokenizer included)."""
    from memtrain.model.data import build_tokenizer
    from memtrain.model.build import build_config

    tokenizer = build_tokenizer(recipe.data.tokenizer)
    return build_config(recipe.model, tokenizer.vocab_size, seq_len or recipe.data.seq_len)


# --------------------------------------------------------------------------- prediction

OFFLOAD = "+offload"


def choice_mode(choice: str) -> tuple[str, bool]:
    """'full+offload' -> ('full', True); 'attn' -> ('attn', False)."""
    return (choice[: -len(OFFLOAD)], True) if choice.endswith(OFFLOAD) else (choice, False)


def allocator_margin(profile: ActivationProfile) -> int:
    """The allocator margin of a step (CUDA only): see ALLOCATOR_MARGIN."""
    if profile.target.device != "cuda":
        return 0
    return int(ALLOCATOR_MARGIN * profile.largest_block) + ALLOCATOR_MARGIN_BYTES


@dataclass
class Prediction:
    """Predicted peak device memory of one training step, by component (bytes)."""

    model_states: ModelStates
    saved_activations: int  # at the end of the forward (what ActivationMeter measures), device part
    saved_per_layer: dict[str, int]  # per choice: bytes one layer keeps on the device
    recompute_working_set: int  # the largest recomputed unit's backward working set (a sqrt segment: all its layers)
    logits_and_loss: int  # saved outside the layers plus the head's transient peak
    activation_peak: int  # the activation part of the peak, over forward, loss and backward
    margin: int  # allocator margin (CUDA only): ALLOCATOR_MARGIN, measured on an H100
    phase: str  # where the peak happens
    host_activations: int = 0  # offloaded checkpoints on the host
    prefetched: int = 0  # in activation_peak: offloaded inputs restored ahead of their layers (prefetch)
    side_stream: int = 0  # in activation_peak: an offloaded input its device-to-host copy still holds (CUDA)
    reduce_buffers: int = 0  # ZeRO-1/2 reduce buckets and scratch at the peak (0 when it is in the forward)
    notes: tuple[str, ...] = ()  # what the prediction leaves out or assumes (e.g. a modules pattern not modelled)

    @property
    def peak(self) -> int:
        """The larger of the forward/backward peak and the optimizer step's (no activations then)."""
        return self.model_states.total + max(self.activation_peak + self.reduce_buffers,
                                             self.model_states.update) + self.margin

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_states"]["total"] = self.model_states.total
        d["peak"] = self.peak
        return d


def layer_footprint(profile: ActivationProfile, choice: str) -> tuple[int, int, int]:
    """(resident, forward transient, backward transient) of one layer on the device for a choice."""
    mode, offload = choice_mode(choice)
    c = profile.layers[mode]
    moved = c.input_bytes if offload else 0
    return c.resident - moved, c.fwd_excess, c.bwd_excess + moved  # offloaded input comes back for backward


@dataclass(frozen=True)
class Unit:
    """One checkpointed call of a plan in layer order: a layer (`layers` 1), or a sqrt segment of
    `layers` consecutive full layers recomputed as one unit."""

    choice: str
    first: int  # its first layer
    layers: int = 1

    @property
    def mode(self) -> str:
        return choice_mode(self.choice)[0]

    @property
    def offload(self) -> bool:
        return choice_mode(self.choice)[1]

    @property
    def slot(self) -> bool:
        """Whether memtrain's offloader sees it (a checkpointed layer or segment; not modules: patterns)."""
        return self.mode != KEEP and not self.mode.startswith(MODULES)

    def name(self) -> str:
        return f"layer {self.first}" if self.layers == 1 else f"layers {self.first}-{self.first + self.layers - 1}"


def plan_units(choices: tuple[str, ...], segments=()) -> list[Unit]:
    """Per-layer choices and sqrt segments ((start, stop) ranges of full layers) -> units in layer order."""
    stops = dict(segments)
    units, i = [], 0
    while i < len(choices):
        k = stops.get(i, i + 1) - i
        units.append(Unit(choices[i], i, k))
        i += k
    return units


def unit_footprint(profile: ActivationProfile, unit: Unit) -> tuple[int, int, int]:
    """(resident, forward transient, backward transient) of a unit.

    A segment of k full layers keeps only its input: it leaves one full layer's resident bytes
    (its output) alive; inside its forward the previous layer's output is alive while the next
    layer runs; its backward recomputes all k layers at once, keeping everything, so its working
    set is k-1 kept layers' resident bytes plus one full layer's recompute-and-backward set.
    """
    if unit.layers == 1:
        return layer_footprint(profile, unit.choice)
    keep, full = profile.layers[KEEP], profile.layers[unit.mode]
    moved = full.input_bytes if unit.offload else 0
    fwd = max(full.fwd_excess, full.resident + full.fwd_excess)
    bwd = (unit.layers - 1) * keep.resident + full.bwd_excess + moved
    return full.resident - moved, fwd, bwd


def _walk(profile: ActivationProfile, units: list[Unit], prefetch_depth: int, side_stream: bool,
          backward_extra: int):
    """Every candidate peak of a plan: (activation bytes, phase, prefetched, side-stream bytes, in the backward).

    Forward of unit u: base + resident of units < u + its forward transient (+ on CUDA the input of
    the unit before it, when offloaded, until its device-to-host copy is done: the copy overlaps
    the next unit's forward, and `record_stream` keeps the memory until then).
    Head (logits, loss, their backward): base + all residents + head transient.
    Backward of unit u: base + residents of units <= u + head_net + its backward transient
    + the offloaded inputs memtrain.recompute.offload has restored ahead: when the backward reaches a
    checkpointed unit it copies back the inputs of the next `prefetch_depth` offloaded units it
    will recompute, so during u's backward the nearest `prefetch_depth` offloaded units below u
    are on the device too (once any checkpointed unit at or above u has been reached).
    `backward_extra` (ZeRO-1/2 reduce buffers) counts in the head, backward and embedding backward.
    """
    inputs = [profile.layers[u.mode].input_bytes if u.offload else 0 for u in units]
    reached = [False] * len(units)  # some checkpointed unit at or above u: the prefetch has started
    for u in range(len(units) - 1, -1, -1):
        reached[u] = units[u].slot or (u + 1 < len(units) and reached[u + 1])
    out, prefix = [], profile.base
    for u, unit in enumerate(units):
        resident, fwd, bwd = unit_footprint(profile, unit)
        side = inputs[u - 1] if side_stream and u > 0 else 0
        ahead = 0
        if prefetch_depth and reached[u]:
            below = [inputs[j] for j in range(u - 1, -1, -1) if units[j].offload][:prefetch_depth]
            ahead = sum(below)
        out.append((prefix + fwd + side, f"forward of {unit.name()}", 0, side, False))
        out.append((prefix + resident + profile.head_net + bwd + ahead, f"backward of {unit.name()}", ahead, 0, True))
        prefix += resident
    out.append((prefix + profile.head_excess, "logits/loss", 0, 0, True))
    out.append((profile.base + profile.head_net + profile.tail_excess, "embedding backward", 0, 0, True))
    return out


def _best(candidates, backward_extra: int):
    return max(candidates, key=lambda c: c[0] + (backward_extra if c[4] else 0))


def activation_peak(profile: ActivationProfile, choices: tuple[str, ...], segments=(),
                    prefetch_depth: Optional[int] = None, backward_extra: int = 0) -> tuple[int, str]:
    """The activation peak of a plan, and its phase (see `_walk`). `backward_extra` takes part in
    choosing the phase but is not in the returned bytes."""
    from memtrain.recompute.offload import PREFETCH_DEPTH

    depth = PREFETCH_DEPTH if prefetch_depth is None else prefetch_depth
    best = _best(_walk(profile, plan_units(choices, segments), depth, profile.target.device == "cuda" and depth > 0,
                       backward_extra), backward_extra)
    return best[0], best[1]


def predict(profile: ActivationProfile, states: ModelStates, choices: tuple[str, ...], segments=(),
            offload_impl: str = "memtrain", notes: tuple[str, ...] = ()) -> Prediction:
    """The prediction for per-layer choices (modes, '+offload' where the layer's input goes to the
    host) and sqrt segments. memtrain's offload prefetches PREFETCH_DEPTH layers ahead and copies
    on a side stream; DeepSpeed's own CPU_CHECKPOINT (offload_impl 'deepspeed') brings each input
    back when its recompute needs it."""
    from memtrain.recompute.offload import PREFETCH_DEPTH

    memtrain = offload_impl == "memtrain"
    depth = PREFETCH_DEPTH if memtrain else 0
    units = plan_units(choices, segments)
    value, phase, ahead, side, backward = _best(
        _walk(profile, units, depth, profile.target.device == "cuda" and memtrain, states.backward), states.backward)
    saved_per = {}
    saved = profile.outside_saved
    for unit in units:
        c = profile.layers[unit.mode]
        key = unit.choice if unit.layers == 1 else f"{unit.choice} (segment of {unit.layers})"
        saved_per[key] = c.saved - (c.input_bytes if unit.offload else 0)
        saved += saved_per[key]
    recomputed = [unit_footprint(profile, u)[2] for u in units if u.mode != KEEP]
    host = sum(profile.layers[u.mode].input_bytes for u in units if u.offload)
    return Prediction(
        model_states=states,
        saved_activations=saved,
        saved_per_layer=saved_per,
        recompute_working_set=max(recomputed, default=0),
        logits_and_loss=profile.outside_saved + profile.head_excess,
        activation_peak=value,
        margin=allocator_margin(profile),
        phase=phase,
        host_activations=host,
        prefetched=ahead,
        side_stream=side,
        reduce_buffers=states.backward if backward else 0,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- any ACPlan

def _layer_module_names(model) -> tuple[str, list[str]]:
    """(path of the decoder-layer list, module paths inside layer 0 relative to it, '' = the layer)."""
    from memtrain.model.build import decoder_layers

    path, layers = decoder_layers(model)
    return path, [n for n, _ in layers[0].named_modules()]


def plan_choices(plan: ACPlan, model1, num_layers: int) -> tuple[tuple[str, ...], list[str]]:
    """Per-layer choices (measured mode keys, '+offload') of an ACPlan, and notes on what is not modelled.

    `model1` is a 1-layer model of the family (fake or meta tensors): module paths of layer i are
    those of layer 0 with the index replaced. Patterns go as apply_plan takes them: in order,
    skipping a match inside (or around) a module already recomputed. Inside layer i, the matched
    set {the layer} is mode full, {its attention / MLP sublayer} mode attn / mlp, anything else a
    measured `modules_mode`. Matches outside the decoder layers are not modelled (noted).
    """
    layer_path, inside = _layer_module_names(model1)
    outside = [n for n, _ in model1.named_modules() if n and not (n == layer_path or n.startswith(layer_path + "."))]
    names = list(outside)
    for i in range(num_layers):
        names += [f"{layer_path}.{i}" + (f".{rel}" if rel else "") for rel in inside]
    sub = {}
    layer0 = dict(model1.named_modules())[f"{layer_path}.0"]
    for mode in (ATTN, MLP):
        try:
            sub[mode] = next(n for n, m in layer0.named_children() if m is _sublayer(layer0, mode))
        except Exception:  # noqa: BLE001 - a family without that sublayer
            pass
    taken = set()
    for i, mode in enumerate(plan.layers):
        if mode in (FULL, OP):
            taken.add(f"{layer_path}.{i}")
        elif mode in sub:
            taken.add(f"{layer_path}.{i}.{sub[mode]}")
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    notes, unmodelled = [], []
    for text in plan.modules:
        rx = _pattern(text)
        found = [n for n in names if rx.match(n)]
        if not found:
            notes.append(f"modules pattern '{text}' matches no module (apply_plan refuses it); not modelled")
        for name in found:
            if any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
                continue
            taken.add(name)
            rest = name[len(layer_path) + 1:] if name.startswith(layer_path + ".") else ""
            index, _, rel = rest.partition(".")
            if not rest or not index.isdigit():
                unmodelled.append(name)
                continue
            per_layer[int(index)].append(rel)
    if unmodelled:
        notes.append(f"modules pattern matches outside the decoder layers not modelled (predicted as kept): "
                     f"{', '.join(unmodelled[:4])}" + (" ..." if len(unmodelled) > 4 else ""))
    choices = []
    for i, mode in enumerate(plan.layers):
        rels = per_layer[i]
        if mode == KEEP and rels:
            if rels == [""]:
                mode = FULL
            elif len(rels) == 1 and rels[0] == sub.get(ATTN):
                mode = ATTN
            elif len(rels) == 1 and rels[0] == sub.get(MLP):
                mode = MLP
            else:
                mode = modules_mode(rels)
        offload = i < len(plan.offload) and plan.offload[i] and plan.cpu_checkpointing
        choices.append(mode + (OFFLOAD if offload and mode != KEEP else ""))
    return tuple(choices), notes


def predict_plan(config, target: Target, ds_config: dict, plan: ACPlan) -> Prediction:
    """The prediction for any ACPlan the trainer runs (see memtrain.memory.planner.predict_run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model1 = _fake_model(config, 1, target)
        choices, notes = plan_choices(plan, model1, config.num_hidden_layers)
    extra = tuple(dict.fromkeys(choice_mode(c)[0] for c in choices if c.startswith(MODULES)))
    profile = profile_activations(config, target, (*supported_modes(), *extra))
    states = model_states(profile, ds_config, target)
    if plan.partition_activations and target.tp <= 1:
        notes.append("partition_activations not modelled (it shards nothing without model parallelism)")
    if tensor_parallel.note(config, target.tp):
        notes.append(tensor_parallel.note(config, target.tp))
    if target.trained(profile.num_params) < profile.num_params and target.lora is None:
        notes.append("frozen parameters: gradients and optimizer states counted for the trainable ones only; "
                     "activations measured with every weight trainable (a frozen layer keeps less for its "
                     "backward, so they are an upper bound)")
    return predict(profile, states, choices, plan.segments, plan.offload_impl, tuple(notes))


# --------------------------------------------------------------------------- device rates

@dataclass(frozen=True)
class Rates:
    """Measured speeds of this machine's device, for the planner's step-time model."""

    flops_per_s: float  # dense matmul in the compute dtype
    bytes_per_s: float  # device memory copy (bytes written per second)
    host_bytes_per_s: float  # device <-> host copy; 0 where there is no separate device memory
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def _timed(fn, reps: int = 3) -> float:
    from memtrain.train.metrics import synchronize

    fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / reps


def measure_rates(dtype: str = "float32") -> Rates:
    """A few quick timings on this machine's device (a fraction of a second on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype) if device == "cuda" else torch.float32  # CPU matmuls run fastest in fp32
    n = 4096 if device == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dt)
    flops = 2 * n**3 / _timed(lambda: a @ a)
    buf = torch.empty(64 << 20 if device == "cuda" else 16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    copy_bw = buf.numel() / _timed(lambda: dst.copy_(buf))
    host_bw = 0.0
    if device == "cuda":
        host = torch.empty_like(buf, device="cpu").pin_memory()
        host_bw = buf.numel() / _timed(lambda: host.copy_(buf, non_blocking=True))
    return Rates(flops, copy_bw, host_bw, device)

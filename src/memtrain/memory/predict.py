"""The predicted peak of a step: per-layer activation costs walked through forward and backward, plus model states.

The live bytes at any point are prefix sums of per-layer costs (`activation_peak`), which tests check
against real steps. Any ACPlan maps onto it (`predict_plan`): per-layer modes, sqrt segments, modules
patterns, memtrain's offload, ZeRO-1/2 reduce buckets (backward only), and the allocator margin.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.recompute.policy import ACPlan, ATTN, FULL, KEEP, MLP, LayerChoice, as_choice
from memtrain.recompute.units import ModelPaths, model_paths, recompute_units
from memtrain.memory import tensor_parallel
from memtrain.memory.target import Target
from memtrain.memory.states import ModelStates, Release, model_states
from memtrain.memory.profile import (MODULES, ActivationProfile, fake_model, measured_part, modules_mode,
                                     profile_activations, supported_modes)
from memtrain.recompute.offload import PREFETCH_DEPTH

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
    reduce_buffers: int = 0  # reduce buffers and the reduction's copy at the peak beyond its activations (0 in the forward)
    released: int = 0  # ZeRO-3: gathered parameters (in model_states.total) already freed at the peak (backward only)
    notes: tuple[str, ...] = ()  # what the prediction leaves out or assumes (e.g. a modules pattern not modelled)

    @property
    def peak(self) -> int:
        """The larger of the forward/backward peak and the optimizer step's (no activations then)."""
        return self.model_states.total + max(self.activation_peak + self.reduce_buffers - self.released,
                                             self.model_states.without_activations) + self.margin

    @property
    def peak_at(self) -> str:
        """Where `peak` is: `phase`, or after the backward where what is held then without activations is more (the
        optimizer step's gradients: policy full's peak on one H100, reports/readme/gpu-h100-prediction.md)."""
        states = self.model_states
        if states.without_activations <= self.activation_peak + self.reduce_buffers - self.released:
            return self.phase
        return "optimizer step" if states.update >= states.allreduce_copy else "gradient all-reduce"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_states"]["total"] = self.model_states.total
        d["peak"] = self.peak
        d["peak_at"] = self.peak_at
        return d


def layer_footprint(profile: ActivationProfile, choice) -> tuple[int, int, int]:
    """(resident, forward transient, backward transient) of one layer on the device for a choice."""
    choice = as_choice(choice)
    c = profile.layers[choice.mode]
    moved = c.input_bytes if choice.offload else 0
    return c.resident - moved, c.fwd_excess, c.bwd_excess + moved  # offloaded input comes back for backward


@dataclass(frozen=True)
class Unit:
    """One checkpointed call of a plan in layer order: a layer (`layers` 1), or a sqrt segment of
    `layers` consecutive full layers recomputed as one unit."""

    choice: LayerChoice
    first: int  # its first layer
    layers: int = 1

    @property
    def mode(self) -> str:
        return self.choice.mode

    @property
    def offload(self) -> bool:
        return self.choice.offload

    @property
    def slot(self) -> bool:
        """Whether memtrain's offloader sees it (a checkpointed layer or segment; not modules: patterns)."""
        return self.mode != KEEP and not self.mode.startswith(MODULES)

    def name(self) -> str:
        return f"layer {self.first}" if self.layers == 1 else f"layers {self.first}-{self.first + self.layers - 1}"


def plan_units(choices, segments=()) -> list[Unit]:
    """Per-layer choices (LayerChoice or mode strings) and sqrt segments ((start, stop) ranges of full layers)
    -> units in layer order."""
    stops = dict(segments)
    units, i = [], 0
    while i < len(choices):
        k = stops.get(i, i + 1) - i
        units.append(Unit(as_choice(choices[i]), i, k))
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
          reduction: int = 0, release: Release = Release()):
    """Every candidate peak of a plan: (activation bytes, phase, prefetched, side-stream bytes, in the backward,
    the reduction's bytes beyond the phase's transient, the gathered bytes ZeRO-3 has released by then).

    Forward of unit u: base + resident of units < u + its forward transient (+ on CUDA the input of
    the unit before it, when offloaded, until its device-to-host copy is done: the copy overlaps
    the next unit's forward, and `record_stream` keeps the memory until then).
    Head (logits, loss, their backward): base + all residents + head transient.
    Backward of unit u: base + residents of units <= u + head_net + its backward transient
    + the offloaded inputs memtrain.recompute.offload has restored ahead: when the backward reaches a
    checkpointed unit it copies back the inputs of the next `prefetch_depth` offloaded units it
    will recompute, so during u's backward the nearest `prefetch_depth` offloaded units below u
    are on the device too (once any checkpointed unit at or above u has been reached).
    The ZeRO-1/2 reduce buffers (`ModelStates.backward`) count in the layers' and the embedding's backward, not in
    the head's (its peak comes before the first gradient hook makes them);
    `reduction` (`ModelStates.reduction`, alive only between ops) takes the place of the phase's own transient
    where it is larger: a phase holds max(transient, reduction).
    ZeRO-3 keeping every gathered parameter into the backward frees each layer's after its backward
    (`ModelStates.release`): the backward of unit u holds none of the layers above it.
    """
    inputs = [profile.layers[u.mode].input_bytes if u.offload else 0 for u in units]
    reached = [False] * len(units)  # some checkpointed unit at or above u: the prefetch has started
    for u in range(len(units) - 1, -1, -1):
        reached[u] = units[u].slot or (u + 1 < len(units) and reached[u + 1])
    out, prefix, layers = [], profile.base, sum(unit.layers for unit in units)
    for u, unit in enumerate(units):
        resident, fwd, bwd = unit_footprint(profile, unit)
        side = inputs[u - 1] if side_stream and u > 0 else 0
        ahead = 0
        if prefetch_depth and reached[u]:
            below = [inputs[j] for j in range(u - 1, -1, -1) if units[j].offload][:prefetch_depth]
            ahead = sum(below)
        out.append((prefix + fwd + side, f"forward of {unit.name()}", 0, side, False, 0, 0))
        out.append((prefix + resident + profile.head_net + bwd + ahead, f"backward of {unit.name()}", ahead, 0, True,
                    max(reduction - bwd, 0), release.after(layers - unit.first - unit.layers)))
        prefix += resident
    # the head's peak (the loss and the logits' gradient) comes before its weight's gradient hook, where ZeRO-1/2 make
    # their buckets (DeepSpeed 0.19.8 stage_1_and_2 setup_buckets, at the first hook): none of them is alive yet
    out.append((prefix + profile.head_excess, "logits/loss", 0, 0, False, 0, 0))
    out.append((profile.base + profile.head_net + profile.tail_excess, "embedding backward", 0, 0, True,
                max(reduction - profile.tail_excess, 0), release.after(layers)))
    return out


def _best(candidates, backward_extra: int):
    """The candidate of the most bytes with the backward's buffers (`backward_extra` and its reduction excess) and
    without what ZeRO-3 has released by then."""
    return max(candidates, key=lambda c: c[0] + (backward_extra + c[5] - c[6] if c[4] else 0))


def activation_peak(profile: ActivationProfile, choices, segments=(),
                    prefetch_depth: Optional[int] = None, backward_extra: int = 0, reduction: int = 0,
                    release: Release = Release()) -> tuple[int, str]:
    """The activation peak of a plan, and its phase (see `_walk`). `backward_extra`, `reduction` and `release` take
    part in choosing the phase but are not in the returned bytes."""
    depth = PREFETCH_DEPTH if prefetch_depth is None else prefetch_depth
    best = _best(_walk(profile, plan_units(choices, segments), depth, profile.target.device == "cuda" and depth > 0,
                       reduction, release), backward_extra)
    return best[0], best[1]


def predict(profile: ActivationProfile, states: ModelStates, choices, segments=(),
            offload_impl: str = "memtrain", notes: tuple[str, ...] = ()) -> Prediction:
    """The prediction for per-layer choices (LayerChoice, or mode strings for layers kept on the device)
    and sqrt segments. memtrain's offload prefetches PREFETCH_DEPTH layers ahead and copies
    on a side stream; DeepSpeed's own CPU_CHECKPOINT (offload_impl 'deepspeed') brings each input
    back when its recompute needs it."""
    memtrain = offload_impl == "memtrain"
    depth = PREFETCH_DEPTH if memtrain else 0
    units = plan_units(choices, segments)
    value, phase, ahead, side, backward, excess, released = _best(
        _walk(profile, units, depth, profile.target.device == "cuda" and memtrain, states.reduction, states.release),
        states.backward)
    saved_per = {}
    saved = profile.outside_saved
    for unit in units:
        c = profile.layers[unit.mode]
        key = str(unit.choice) if unit.layers == 1 else f"{unit.choice} (segment of {unit.layers})"
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
        reduce_buffers=states.backward + excess if backward else 0,
        released=released if backward else 0,
        notes=tuple(notes),
    )


def eval_peak(profile: ActivationProfile, states: ModelStates) -> int:
    """Peak device bytes of a held-out eval micro-batch (memtrain.train.evaluate): one forward under no_grad, with
    the model states as in training (ZeRO-3 gathers a layer at a time, as in the forward). Nothing is saved for a
    backward, so a layer holds only the running hidden states (in `base`) and its own forward transient, which is
    what a fully recomputed layer's forward measures (it saves nothing either); then the head's transient, whose
    measure includes its backward's (an upper bound here). Never above a training step's peak, which has each of
    these terms and more at its own peak."""
    layer = profile.layers.get(FULL) or profile.layers[KEEP]
    return states.total + profile.base + max(layer.fwd_excess, profile.head_excess) + allocator_margin(profile)


# --------------------------------------------------------------------------- any ACPlan

_LAYER_PATHS: dict[tuple, ModelPaths] = {}  # by (config, measured part of the target): built once per process


def layer_paths(config, target: Target) -> ModelPaths:
    """The module paths of the 1-layer fake model a profile measures at `target` (its adapters, tiled MLPs and loss
    installed). Memoized: building the model is most of a prediction's time once its profile is measured, and the
    paths depend on nothing else."""
    key = (config.to_json_string(), measured_part(target))
    if key not in _LAYER_PATHS:
        with FakeTensorMode(allow_non_fake_inputs=True):
            _LAYER_PATHS[key] = model_paths(fake_model(config, 1, target))
    return _LAYER_PATHS[key]


def predicted_paths(one: ModelPaths, num_layers: int) -> ModelPaths:
    """The module paths of a `num_layers`-layer model of the family, from a 1-layer one's (`layer_paths`): layer
    i's paths are layer 0's with the index replaced, in module order."""
    head = f"{one.layer_path}.0"
    names = []
    for name in one.names:
        if name == head:
            names += [f"{one.layer_path}.{i}" + rest for i in range(num_layers) for rest in
                      ("", *(n[len(head):] for n in one.names if n.startswith(head + ".")))]
        elif not name.startswith(head + "."):
            names.append(name)
    return ModelPaths(tuple(names), one.layer_path, one.layers * num_layers, one.model_type)


def plan_choices(plan: ACPlan, one: ModelPaths, num_layers: int) -> tuple[tuple[LayerChoice, ...], list[str]]:
    """Per-layer choices (measured mode keys, offload) of an ACPlan, and notes on what is not modelled.

    The units are those `apply_plan` installs (`memtrain.recompute.units.recompute_units`), on the paths of a
    `num_layers`-layer model with the 1-layer model's paths `one` (`predicted_paths`). Inside layer i, the units {the
    layer} are mode full (or its own mode), {its attention / MLP sublayer} mode attn / mlp, anything else a measured
    `modules_mode`. Units outside the decoder layers are not modelled (noted), nor is the offload of a
    `modules_mode` set (noted: predicted on the device).
    """
    units, _ = recompute_units(plan, predicted_paths(one, num_layers))
    per_layer: list[list] = [[] for _ in range(num_layers)]
    outside = []
    for unit in units:
        (per_layer[unit.layer] if unit.layer is not None else outside).append(unit)
    notes = []
    if outside:
        names = [u.name for u in outside]
        notes.append(f"modules pattern matches outside the decoder layers not modelled (predicted as kept): "
                     f"{', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
    layer0 = one.layers[0]
    choices, unmodelled_offload = [], []
    for i, found in enumerate(per_layer):
        mode, offload = KEEP, any(u.offload for u in found)
        if len(found) == 1 and (found[0].inside == "" or found[0].inside in (layer0.attn, layer0.mlp)):
            unit = found[0]
            mode = unit.mode if not unit.matched else FULL if unit.inside == "" else \
                ATTN if unit.inside == layer0.attn else MLP
        elif found:
            mode = modules_mode([u.inside for u in found])
            if offload:
                unmodelled_offload.append(i)
                offload = False
        choices.append(LayerChoice(mode, offload))
    if unmodelled_offload:
        notes.append(f"offload of modules matched inside layers {','.join(map(str, unmodelled_offload))} not "
                     "modelled (predicted on the device)")
    return tuple(choices), notes


def predict_plan(config, target: Target, ds_config: dict, plan: ACPlan) -> Prediction:
    """The prediction for any ACPlan the trainer runs (see memtrain.memory.planner.predict_run)."""
    choices, notes = plan_choices(plan, layer_paths(config, target), config.num_hidden_layers)
    extra = tuple(dict.fromkeys(c.mode for c in choices if c.mode.startswith(MODULES)))
    profile = profile_activations(config, target, (*supported_modes(), *extra), count_flops=False)  # reads no FLOPs
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



"""`policy: auto`: the per-layer recompute and offload plan that fits a memory budget in the least time.

Per layer: keep / op / attn / mlp / full / full+offload, chosen to fit a memory budget with the
least predicted step time. Solved exactly by dynamic programming over layers.

Step-time model (only the differences between plans matter; the step itself is the same work):
* recompute of a layer = its measured extra backward FLOPs / the device's matmul rate
  + the extra bytes its recompute writes / the device's copy rate (memory-bound ops),
  or, where longer, the aten ops it dispatches again x the host's seconds per op (`recompute_seconds`);
* offload of a layer's checkpointed input = its bytes / host-link rate, each way, less what
  overlaps: the copy out overlaps the next layer's forward, the copy back the backward of the
  `PREFETCH_DEPTH` layers memtrain.recompute.offload prefetches ahead.

Memory model: `memtrain.memory.predict` (peaks over forward, loss and backward; prefix sums of
what layers leave alive). The DP keeps, after each layer, the Pareto front of (bytes left alive
so far, predicted time); every constraint grows with the bytes so far, so a state with more bytes
and more time can never lead to a better plan, and dropping it keeps the search exact.

Why not torch.distributed._tools.sac_ilp: it solves per-module selective-recompute ratios with an
ILP through PuLP (not a dependency here), from SACEstimator's per-op statistics of one real run, and
models neither host offload nor ZeRO's model states and buffers. The choice here is per decoder layer
among whole-layer modes and offload, which a DP over layers solves exactly in milliseconds.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional

import numpy as np

from memtrain.config.recompute_spec import RecomputeSpec
from memtrain.recompute.policy import ACPlan, build_plan
from memtrain.errors import UserError
from memtrain.units import gib
from memtrain.memory.predict import (LayerChoice, Prediction, activation_peak, allocator_margin, layer_footprint,
                                    predict)
from memtrain.memory.profile import ActivationProfile, profile_activations
from memtrain.memory.rates import Rates, measure_rates
from memtrain.memory.states import ModelStates, Release, model_states
from memtrain.memory.target import Target, make_target, model_and_config, recompute_spec
from memtrain.config.ds_config import zero_stage
from memtrain.memory.predict import predict_plan
from memtrain.recompute.offload import PREFETCH_DEPTH

# --------------------------------------------------------------------------- choices and their time

def available_choices(profile: ActivationProfile, backend: str, offload: bool) -> tuple[LayerChoice, ...]:
    """What a layer may do: the measured modes (op only under torch's checkpoint), and full+offload
    where offload saves device memory (a GPU with measured host-link bandwidth)."""
    modes = [m for m in ("keep", "op", "attn", "mlp", "full") if m in profile.layers]
    if backend == "deepspeed" and "op" in modes:
        modes.remove("op")  # op-level recompute needs torch's non-reentrant checkpoint
    choices = [LayerChoice(m) for m in modes]
    if offload and "full" in modes:
        choices.append(LayerChoice("full", offload=True))
    return tuple(choices)


def recompute_seconds(device_s: float, ops: int, host_op_s: float) -> float:
    """A layer's recompute: the longer of its device seconds and the host's seconds to dispatch its ops again
    (kernels run asynchronously, so the device waits only for a slower host)."""
    return max(device_s, ops * host_op_s)


def choice_seconds(profile: ActivationProfile, rates: Rates, choice: LayerChoice,
                   ops: Optional[Mapping[str, int]] = None) -> float:
    """Predicted extra step time of one layer under `choice`, over keeping everything. `ops`: the aten ops each
    mode's recompute dispatches again (memtrain.memory.recompute_ops), priced at `rates.host_op_s`."""
    c = profile.layers[choice.mode]
    seconds = recompute_seconds(c.recompute_flops / rates.flops_per_s + c.recompute_written / rates.bytes_per_s,
                                (ops or {}).get(choice.mode, 0), rates.host_op_s)
    if choice.offload:
        copy_s = c.input_bytes / rates.host_bytes_per_s
        fwd_s = c.fwd_flops / rates.flops_per_s
        bwd_s = c.bwd_flops / rates.flops_per_s
        seconds += max(0.0, copy_s - fwd_s) + max(0.0, copy_s - PREFETCH_DEPTH * bwd_s)
    return seconds


# --------------------------------------------------------------------------- the exact DP

def _prefetch_unit(profile: ActivationProfile, choices: tuple[LayerChoice, ...]) -> tuple[int, int]:
    """(offloaded layers memtrain.recompute.offload restores ahead, bytes of one offloaded input); (0, 0) without offload."""
    offloaded = [c for c in choices if c.offload]
    if not offloaded:
        return 0, 0
    return PREFETCH_DEPTH, max(profile.layers[c.mode].input_bytes for c in offloaded)


def solve(profile: ActivationProfile, activation_limit: int, choices: tuple[LayerChoice, ...],
          seconds: dict[LayerChoice, float], num_layers: Optional[int] = None,
          backward_extra: int = 0, reduction: int = 0, release: Release = Release()) -> Optional[tuple[LayerChoice, ...]]:
    """The plan with the least predicted time whose activation peak fits `activation_limit`; None if none.

    State after layer i: bytes its layers leave alive (the prefix, which every later constraint
    adds to), the time so far, and what the offload terms depend on: how many offloaded layers lie
    below (up to PREFETCH_DEPTH: their inputs are restored ahead during a later backward) and
    whether the layer just placed is offloaded (on CUDA its copy holds its input through the next
    forward). Exact within each such key: only states worse in both bytes and time are dropped.
    `backward_extra` (ZeRO-1/2 reduce buffers) adds to every backward-phase constraint, and `reduction` (their
    flatten copy, alive only between ops: ModelStates.reduction) takes a phase's transient's place where larger;
    `release` (ModelStates.release: ZeRO-3's gathered parameters freed in the backward) gives layer i's backward
    constraint what the layers above it have released, as memory.predict's walk does. The
    prefetch term is counted for a kept layer as well (exact when a checkpointed layer lies above it).
    Each layer's front is expanded by every choice at once (numpy), and a state whose bytes cannot fit
    the last constraint even with the least-resident choice for every later layer is dropped early.
    Of states equal in key and bytes the least time is kept (of equal times, the first: parent, then choice).
    """
    n = num_layers or profile.num_layers
    if profile.base + profile.head_net + max(profile.tail_excess, reduction) + backward_extra - release.after(n) > \
            activation_limit:
        return None  # the loss's tail alone does not fit, whatever the layers do
    dp = _Layers(profile, activation_limit, choices, seconds, backward_extra, reduction, release)
    # the front, sorted by (key, bytes): prefix bytes, seconds, key (offloaded layers below, capped; last offloaded)
    prefix, time, key = np.array([profile.base], dtype=np.int64), np.zeros(1), np.zeros(1, dtype=np.int64)
    history = []  # per layer: (parent state, choice) of each state of its front
    rooms = dp.rooms(n)
    for i in range(n):
        fits = np.flatnonzero(prefix[:, None] <= rooms[i][key])  # state-major, choice-minor: ties resolve in this order
        if not len(fits):
            return None
        parent, chosen, prefix, key = dp.sorted_candidates(prefix, key, fits)
        time = time[parent] + dp.secs[chosen]
        keep = _least_time_per_bytes(prefix, time, key)
        prefix, time, key = prefix[keep], time[keep], key[keep]
        history.append((parent[keep], chosen[keep]))
    fitting = np.flatnonzero(prefix <= dp.final_room)
    if not len(fitting):
        return None
    k = int(fitting[np.lexsort((prefix[fitting], time[fitting]))[0]])  # the least time; of equal ones, fewer bytes
    plan = []
    for parent, chosen in reversed(history):
        plan.append(choices[int(chosen[k])])
        k = int(parent[k])
    return tuple(reversed(plan))


class _Layers:
    """What `solve`'s DP needs of the choices, computed once per solve: each choice's bytes and seconds, the bytes a
    state may hold before a choice still fits, given its key (offloaded layers below, last layer offloaded), and the
    key a choice leads to."""

    def __init__(self, profile: ActivationProfile, limit: int, choices: tuple[LayerChoice, ...],
                 seconds: dict[LayerChoice, float], backward_extra: int, reduction: int = 0,
                 release: Release = Release()):
        depth, inp = _prefetch_unit(profile, choices)
        side = inp if profile.target.device == "cuda" else 0
        terms = np.array([_footprint_terms(profile, c, backward_extra, reduction) for c in choices],
                         dtype=np.int64).reshape(-1, 3)
        self.resident, fwd, bwd = terms[:, 0], terms[:, 1], terms[:, 0] + terms[:, 2]
        offload = np.array([c.offload for c in choices], dtype=np.int64)
        self.secs = np.array([seconds[c] for c in choices], dtype=np.float64)
        below, last_off = np.arange(depth + 1).repeat(2), np.tile([0, 1], depth + 1)  # key k = below * 2 + last_off
        self.next_key = np.minimum(depth, below[:, None] + offload[None, :]) * 2 + offload[None, :]
        # the forward of the choice (with an offloaded input below it still on its copy) and its backward (with the
        # prefetched inputs below it, and what ZeRO-3 released above it: per layer, in `rooms`) fit: prefix <= room
        self.forward_room = limit - side * last_off[:, None] - fwd[None, :]
        self.backward_room = limit - below[:, None] * inp - bwd[None, :]
        self.release = release
        # the last layer does not offload (the backward needs its input first, before any copy back could overlap)
        self.offloads = offload.astype(bool)
        self.least = int(self.resident.min())  # a later layer leaves at least this alive
        self.final_room = limit - profile.head_excess  # what the last prefix must fit (no reduce buffer yet: predict)
        self.key_bits = int(self.next_key.max()).bit_length()

    def rooms(self, n: int) -> np.ndarray:
        """layer x key x choice -> the most bytes a state may hold before the layer takes the choice; it also drops
        early a state that cannot fit the final constraint even with the least-resident choice for every later layer."""
        final = self.final_room - (n - 1 - np.arange(n))[:, None] * self.least - self.resident[None, :]
        released = np.array([self.release.after(n - 1 - i) for i in range(n)], dtype=np.int64)
        rooms = np.minimum(np.minimum(self.forward_room[None, :, :],
                                      self.backward_room[None, :, :] + released[:, None, None]), final[:, None, :])
        rooms[n - 1][:, self.offloads] = np.iinfo(np.int64).min
        return rooms

    def sorted_candidates(self, prefix: np.ndarray, key: np.ndarray, index: np.ndarray):
        """(parent, choice, prefix, key) of the fitting (state, choice) pairs (`index`: state * choices + choice),
        sorted by (key, prefix, parent, choice): packed into one int64 where they fit in 63 bits, else by lexsort."""
        parent, chosen = np.divmod(index, len(self.secs))
        new_prefix, new_key = prefix[parent] + self.resident[chosen], self.next_key[key[parent], chosen]
        low = int(new_prefix.min())
        index_bits, prefix_bits = int(index[-1]).bit_length(), (int(new_prefix.max()) - low).bit_length()
        if index_bits + prefix_bits + self.key_bits > 63:
            order = np.lexsort((new_prefix, new_key))  # stable: parent-major, choice-minor within equal ones
            return parent[order], chosen[order], new_prefix[order], new_key[order]
        packed = np.sort((new_key << (prefix_bits + index_bits)) | ((new_prefix - low) << index_bits) | index)
        parent, chosen = np.divmod(packed & ((1 << index_bits) - 1), len(self.secs))
        return (parent, chosen, ((packed >> index_bits) & ((1 << prefix_bits) - 1)) + low,
                packed >> (prefix_bits + index_bits))


def _least_time_per_bytes(prefix: np.ndarray, time: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Of candidates sorted by (key, prefix, order of ties), the indices of those no candidate of the same key beats
    in both bytes and time: in each run of equal (key, prefix) the first of least time, where it lies below the
    least time of the key's smaller prefixes (by more than 1e-15). Kept in order: by key, then increasing bytes."""
    new_run = np.empty(len(prefix), dtype=bool)
    new_run[0] = True
    np.not_equal(prefix[1:], prefix[:-1], out=new_run[1:])
    new_run[1:] |= key[1:] != key[:-1]
    starts = np.flatnonzero(new_run)
    least = np.minimum.reduceat(time, starts)
    groups = np.flatnonzero(least < _earlier_least(least, key[starts]) - 1e-15)
    if len(starts) == len(prefix):  # every run one candidate
        return groups
    at_least = np.flatnonzero(time == least[np.cumsum(new_run) - 1])
    return at_least[np.searchsorted(at_least, starts[groups])]


def _earlier_least(values: np.ndarray, key: np.ndarray) -> np.ndarray:
    """For each value, the least of the values before it with the same key (inf for the first); `key` sorted."""
    before = np.empty_like(values)
    before[0] = np.inf
    np.minimum.accumulate(values[:-1], out=before[1:])
    if key[0] == key[-1]:
        return before
    firsts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    for start, end in zip(firsts[1:], np.append(firsts[2:], len(values))):  # each later key starts afresh
        before[start] = np.inf
        np.minimum.accumulate(values[start:end - 1], out=before[start + 1:end])
    return before


def _footprint_terms(profile: ActivationProfile, choice: LayerChoice, backward_extra: int,
                     reduction: int = 0) -> tuple[int, int, int]:
    """(resident, forward transient, backward transient (or `reduction`, the larger) with the head's net bytes and
    `backward_extra`)."""
    resident, fwd, bwd = layer_footprint(profile, choice)
    return resident, fwd, max(bwd, reduction) + profile.head_net + backward_extra


def feasible(profile: ActivationProfile, activation_limit: int, choices: tuple[LayerChoice, ...],
             backward_extra: int = 0, reduction: int = 0,
             release: Release = Release()) -> Optional[tuple[LayerChoice, ...]]:
    """Some plan whose activation peak fits, or None: the DP with every choice free, which keeps
    one state (the fewest bytes alive) per offload key and layer."""
    return solve(profile, activation_limit, choices, {c: 0.0 for c in choices}, backward_extra=backward_extra,
                 reduction=reduction, release=release)


def smallest_peak(profile: ActivationProfile, choices: tuple[LayerChoice, ...],
                  backward_extra: int = 0, reduction: int = 0,
                  release: Release = Release()) -> tuple[int, tuple[LayerChoice, ...]]:
    """The smallest activation peak (with `backward_extra`, `reduction` and `release` in the backward) any plan
    reaches, and a plan reaching it: bisection on the limit with `feasible`."""
    lo, hi = 0, max(activation_peak(profile, (c,) * profile.num_layers)[0]
                    for c in choices if not c.offload) + backward_extra + reduction
    best = feasible(profile, hi, choices, backward_extra, reduction, release)
    while hi - lo > max(4096, hi >> 12):  # to 0.025% of the peak
        mid = (lo + hi) // 2
        plan = feasible(profile, mid, choices, backward_extra, reduction, release)
        if plan is None:
            lo = mid
        else:
            hi, best = mid, plan
    return activation_peak(profile, best)[0], best


# --------------------------------------------------------------------------- the planner

@dataclass
class PlanResult:
    """What `policy: auto` chose, and why."""

    layers: tuple[LayerChoice, ...]  # per layer
    prediction: Prediction
    budget: int
    seconds: float  # predicted extra step time over keeping everything
    uniform: dict[str, dict] = field(default_factory=dict)  # per choice as printed: the uniform plan's peak, seconds
    rates: Optional[dict] = None

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(c.mode for c in self.layers)

    @property
    def offload(self) -> tuple[bool, ...]:
        return tuple(c.offload for c in self.layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = [str(c) for c in self.layers]
        d["prediction"] = self.prediction.to_dict()
        d["predicted_peak_gib"] = gib(self.prediction.peak)
        return d

    def describe(self) -> str:
        p = self.prediction
        counts = {c: self.layers.count(c) for c in dict.fromkeys(self.layers)}
        return "\n".join([
            f"auto plan: {', '.join(f'{n} x {c}' for c, n in counts.items())} under a budget of "
            f"{gib(self.budget):.3f} GiB; predicted extra time {self.seconds * 1e3:.1f} ms/micro-step",
            f"  predicted peak {gib(p.peak):.3f} GiB = model states {gib(p.model_states.total):.3f} + "
            f"activations {gib(p.activation_peak):.3f} (at {p.phase})"
            + (f" + ZeRO reduce buffers {gib(p.reduce_buffers):.3f}" if p.reduce_buffers else "")
            + f" + allocator margin {gib(p.margin):.3f}",
        ])


def activation_limit(profile: ActivationProfile, states: ModelStates, choices: tuple[LayerChoice, ...],
                     budget: int) -> int:
    """Bytes the activations may peak at: the budget less model states and allocator margin
    (negative when even what is held with no activation alive does not fit: the optimizer step's fp32
    gradients, ZeRO-0's all-reduce copy). The backward's ZeRO-1/2
    reduce buffers are not taken off: `solve` adds them to the backward constraints."""
    margin = allocator_margin(profile)
    limit = budget - states.total - margin
    return limit if states.without_activations <= limit else -1


def predicted_plan(profile: ActivationProfile, states: ModelStates, choices: tuple[LayerChoice, ...],
                   rates: Rates, budget: int) -> Optional[PlanResult]:
    seconds = {c: choice_seconds(profile, rates, c) for c in choices}
    limit = activation_limit(profile, states, choices, budget)
    plan = solve(profile, limit, choices, seconds, backward_extra=states.backward, reduction=states.reduction,
                 release=states.release)
    if plan is None:
        return None
    uniform = {}
    for c in choices:
        pred = predict(profile, states, (c,) * profile.num_layers)
        uniform[str(c)] = {"peak_gib": gib(pred.peak), "seconds": seconds[c] * profile.num_layers,
                      "fits": pred.peak <= budget}
    return PlanResult(plan, predict(profile, states, plan), budget, sum(seconds[c] for c in plan), uniform,
                      rates.to_dict())


def _ds_variant(ds_config: dict, stage: Optional[int] = None, offload_optimizer: bool = False) -> dict:
    cfg = copy.deepcopy(ds_config)
    zero = cfg.setdefault("zero_optimization", {})
    if stage is not None:
        zero["stage"] = stage
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return cfg


def what_fits(profile: ActivationProfile, ds_config: dict, target: Target, choices: tuple[LayerChoice, ...],
              budget: int) -> tuple[float, str]:
    """(smallest achievable peak in GiB, what would fit: micro-batch, GPUs, ZeRO stage, offload)."""
    def fits(prof: ActivationProfile, states: ModelStates) -> bool:
        return feasible(prof, activation_limit(prof, states, choices, budget), choices, *states.backward_terms) is not None

    states = model_states(profile, ds_config, target)
    act, plan = smallest_peak(profile, choices, *states.backward_terms)
    peak = predict(profile, states, plan).peak
    options = []
    for mb in range(target.micro_batch_size - 1, 0, -1):
        if fits(profile.scaled(mb), states):
            options.append(f"train.micro_batch_size={mb}")
            break
    stage = zero_stage(ds_config)
    for world in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if world > target.world_size and stage >= 1:
            t = Target(**{**asdict(target), "world_size": world})
            if fits(profile, model_states(profile, ds_config, t)):
                options.append(f"{world} GPUs")
                break
    for higher in range(stage + 1, 4):
        if fits(profile, model_states(profile, _ds_variant(ds_config, higher), target)):
            options.append(f"zero_optimization.stage={higher}")
            break
    if stage >= 1 and not (ds_config.get("zero_optimization", {}).get("offload_optimizer")):
        if fits(profile, model_states(profile, _ds_variant(ds_config, offload_optimizer=True), target)):
            options.append("zero_optimization.offload_optimizer.device=cpu")
    return gib(peak), (" or ".join(options) if options else "none of a smaller micro-batch, more GPUs, "
                       "a higher ZeRO stage or optimizer offload alone")


def auto_plan(spec: RecomputeSpec, recipe, ds_config: dict, world_size: int, config=None,
              target: Optional[Target] = None, rates: Optional[Rates] = None) -> tuple[ACPlan, PlanResult]:
    """`activation_checkpointing.policy: auto`: the ACPlan that fits `memory_budget` with the least
    predicted step time, among the per-layer choices the run's RecomputeSpec allows (its backend, and
    whether its checkpointed inputs may go to host memory). Raises UserError (one line) when no plan fits."""
    section = spec.section
    if section.memory_budget is None:
        raise UserError("activation_checkpointing.memory_budget: policy 'auto' needs a budget in GiB "
                        "(the predicted peak device memory per GPU must fit it)")
    budget = int(section.memory_budget * (1 << 30))
    target = target or make_target(recipe, ds_config, world_size, spec=spec)
    config = config or model_and_config(recipe)
    profile = profile_activations(config, target)
    states = model_states(profile, ds_config, target)
    rates = rates or measure_rates(target.dtype)
    choices = available_choices(profile, spec.backend, may_offload(spec, target, rates))
    result = predicted_plan(profile, states, choices, rates, budget)
    if result is None:
        peak, hint = what_fits(profile, ds_config, target, choices, budget)
        raise UserError(f"activation_checkpointing.memory_budget: nothing fits {section.memory_budget:g} GiB "
                        f"per device: the smallest achievable predicted peak is {peak:.3f} GiB "
                        f"(model states {gib(states.total):.3f} GiB); would fit: {hint}")
    return build_plan(spec, len(result.modes), layers=result.modes, offload=result.offload), result


def may_offload(spec: RecomputeSpec, target: Target, rates: Rates) -> bool:
    """Whether the planner may send a layer's checkpointed input to host memory: the spec's offload takes
    effect (a GPU run) and this machine measured a host copy rate."""
    return target.device == "cuda" and rates.host_bytes_per_s > 0 and spec.cpu_checkpointing


def suggest_fit(recipe, ds_config: dict, world_size: int, budget_bytes: int) -> str:
    """For an out-of-memory report: the smallest peak memtrain's AC can reach, and what would fit."""
    spec = recompute_spec(recipe, ds_config, world_size=world_size)
    target = make_target(recipe, ds_config, world_size, spec=spec)
    profile = profile_activations(model_and_config(recipe), target)
    choices = available_choices(profile, spec.backend, offload=False)
    peak, hint = what_fits(profile, ds_config, target, choices, budget_bytes)
    if peak * (1 << 30) <= budget_bytes:
        return (f"predicted: activation_checkpointing.policy=auto with memory_budget={gib(budget_bytes):.1f} "
                f"fits (smallest predicted peak {peak:.2f} GiB)")
    return f"predicted smallest peak with any AC plan {peak:.2f} GiB > {gib(budget_bytes):.1f} GiB; would fit: {hint}"


def predict_run(recipe, ds_config: dict, world_size: int, plan: ACPlan, config=None,
                target: Optional[Target] = None, compiled: Optional[bool] = None) -> Prediction:
    """The predicted peak device memory per device of a run under any ACPlan the trainer applies
    (every policy: none, full, every/first, selective, op, sqrt segments, modules patterns, auto,
    with memtrain's or DeepSpeed's offload). Fake tensors only: seconds at start-up.

    `plan.layers[i]` maps to the memory model's choice for layer i (with '+offload' where
    `plan.offload[i]`), `plan.segments` to sqrt units, `plan.modules` to per-layer measured modes
    (see memtrain.memory.predict.plan_choices); what cannot be modelled is said in `Prediction.notes`.
    `ds_config` is the run's DeepSpeed config (resolved or raw: 'auto' values are read as
    memtrain resolves them). `compiled`: the decoder layers run compiled (default: train.compile true; memtrain.memory.target)."""
    target = target or make_target(recipe, ds_config, world_size, compiled=compiled)
    config = config or model_and_config(recipe)
    return predict_plan(config, target, ds_config, plan)

"""`policy: auto`: per layer, keep / op / attn / mlp / full / full+offload, chosen to fit a memory
budget with the least predicted step time. Solved exactly by dynamic programming over layers.

Step-time model (only the differences between plans matter; the step itself is the same work):
* recompute of a layer = its measured extra backward FLOPs / the device's matmul rate
  + the extra bytes its recompute writes / the device's copy rate (memory-bound ops);
* offload of a layer's checkpointed input = its bytes / host-link rate, each way, less what
  overlaps: the copy out overlaps the next layer's forward, the copy back the backward of the
  `PREFETCH_DEPTH` layers memtrain.offload prefetches ahead.

Memory model: `memtrain.memory_model` (peaks over forward, loss and backward; prefix sums of
what layers leave alive). The DP keeps, after each layer, the Pareto front of (bytes left alive
so far, predicted time); every constraint grows with the bytes so far, so a state with more bytes
and more time can never lead to a better plan, and dropping it keeps the search exact.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Optional

from . import ac
from .errors import UserError
from .memory_model import (OFFLOAD, ActivationProfile, ModelStates, Prediction, Rates, Target, activation_peak,
                           choice_mode, gib, layer_footprint, model_states, predict)

# --------------------------------------------------------------------------- choices and their time

def available_choices(profile: ActivationProfile, backend: str, offload: bool) -> tuple[str, ...]:
    """What a layer may do: the measured modes (op only under torch's checkpoint), and full+offload
    where offload saves device memory (a GPU with measured host-link bandwidth)."""
    modes = [m for m in ("keep", "op", "attn", "mlp", "full") if m in profile.layers]
    if backend == "deepspeed" and "op" in modes:
        modes.remove("op")  # op-level recompute needs torch's non-reentrant checkpoint
    if offload and "full" in modes:
        modes.append("full" + OFFLOAD)
    return tuple(modes)


def choice_seconds(profile: ActivationProfile, rates: Rates, choice: str) -> float:
    """Predicted extra step time of one layer under `choice`, over keeping everything."""
    from .offload import PREFETCH_DEPTH

    mode, offload = choice_mode(choice)
    c = profile.layers[mode]
    seconds = c.recompute_flops / rates.flops_per_s + c.recompute_written / rates.bytes_per_s
    if offload:
        copy_s = c.input_bytes / rates.host_bytes_per_s
        fwd_s = c.fwd_flops / rates.flops_per_s
        bwd_s = c.bwd_flops / rates.flops_per_s
        seconds += max(0.0, copy_s - fwd_s) + max(0.0, copy_s - PREFETCH_DEPTH * bwd_s)
    return seconds


# --------------------------------------------------------------------------- the exact DP

def _layer_steps(profile: ActivationProfile, choices: tuple[str, ...], limit: int):
    """Per choice: (resident, the largest prefix that still fits its forward and backward peaks)."""
    steps = {}
    for choice in choices:
        resident, fwd, bwd = layer_footprint(profile, choice)
        # forward: prefix + fwd <= limit; backward: prefix + resident + head_net + bwd <= limit
        steps[choice] = (resident, min(limit - fwd, limit - resident - profile.head_net - bwd))
    return steps


def solve(profile: ActivationProfile, activation_limit: int, choices: tuple[str, ...],
          seconds: dict[str, float], num_layers: Optional[int] = None) -> Optional[tuple[str, ...]]:
    """The plan with the least predicted time whose activation peak fits `activation_limit`; None if none.

    State after layer i: bytes its layers leave alive (the prefix, which every later constraint
    adds to) and the time so far. Exact: only states worse in both are dropped.
    """
    n = num_layers or profile.num_layers
    steps = _layer_steps(profile, choices, activation_limit)
    # last layer: no offload (the backward needs its input first, before any copy back could overlap)
    last_choices = tuple(c for c in choices if not c.endswith(OFFLOAD))
    front = [(profile.base, 0.0, None)]  # (prefix bytes, seconds, back-pointer)
    history = []
    for i in range(n):
        nxt = []
        for idx, (prefix, secs, _) in enumerate(front):
            for choice in (last_choices if i == n - 1 else choices):
                resident, max_prefix = steps[choice]
                if prefix <= max_prefix:
                    nxt.append((prefix + resident, secs + seconds[choice], (idx, choice)))
        nxt.sort(key=lambda s: (s[0], s[1]))
        front, best = [], float("inf")
        for state in nxt:  # Pareto front: increasing bytes, strictly decreasing time
            if state[1] < best - 1e-15:
                front.append(state)
                best = state[1]
        history.append(front)
        if not front:
            return None
    tail = profile.base + profile.head_net + profile.tail_excess
    fitting = [k for k, s in enumerate(front) if s[0] + profile.head_excess <= activation_limit]
    if not fitting or tail > activation_limit:
        return None
    k = min(fitting, key=lambda j: front[j][1])
    plan = []
    for i in range(n - 1, -1, -1):
        _, _, (parent, choice) = history[i][k]
        plan.append(choice)
        k = parent
    return tuple(reversed(plan))


def feasible(profile: ActivationProfile, activation_limit: int, choices: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    """Some plan whose activation peak fits, or None. Exact without the DP: every constraint grows
    with the bytes left alive so far, so taking, layer by layer, the fitting choice that leaves the
    fewest bytes alive keeps every option open."""
    steps = _layer_steps(profile, choices, activation_limit)
    prefix, plan = profile.base, []
    for i in range(profile.num_layers):
        allowed = [c for c in choices if prefix <= steps[c][1]
                   and not (i == profile.num_layers - 1 and c.endswith(OFFLOAD))]
        if not allowed:
            return None
        choice = min(allowed, key=lambda c: steps[c][0])
        plan.append(choice)
        prefix += steps[choice][0]
    tail = profile.base + profile.head_net + profile.tail_excess
    if prefix + profile.head_excess > activation_limit or tail > activation_limit:
        return None
    return tuple(plan)


def smallest_peak(profile: ActivationProfile, choices: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """The smallest activation peak any plan reaches, and a plan reaching it: bisection
    on the limit with `feasible`."""
    lo, hi = 0, max(activation_peak(profile, (c,) * profile.num_layers)[0]
                    for c in choices if not c.endswith(OFFLOAD))
    best = feasible(profile, hi, choices)
    while hi - lo > max(4096, hi >> 12):  # to 0.025% of the peak
        mid = (lo + hi) // 2
        plan = feasible(profile, mid, choices)
        if plan is None:
            lo = mid
        else:
            hi, best = mid, plan
    return activation_peak(profile, best)[0], best


# --------------------------------------------------------------------------- the planner

@dataclass
class PlanResult:
    """What `policy: auto` chose, and why."""

    layers: tuple[str, ...]  # per layer: a choice (mode, or full+offload)
    prediction: Prediction
    budget: int
    seconds: float  # predicted extra step time over keeping everything
    uniform: dict[str, dict] = field(default_factory=dict)  # per choice: peak and seconds of the uniform plan
    rates: Optional[dict] = None

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(choice_mode(c)[0] for c in self.layers)

    @property
    def offload(self) -> tuple[bool, ...]:
        return tuple(choice_mode(c)[1] for c in self.layers)

    def to_dict(self) -> dict:
        d = asdict(self)
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
            f"activations {gib(p.activation_peak):.3f} (at {p.phase}) + allocator margin {gib(p.margin):.3f}",
        ])


def activation_limit(profile: ActivationProfile, states: ModelStates, choices: tuple[str, ...], budget: int) -> int:
    """Bytes the activations may peak at: the budget less model states and allocator margin
    (negative when even the optimizer step's fp32 gradients do not fit)."""
    margin = predict(profile, states, (choices[0],) * profile.num_layers).margin
    limit = budget - states.total - margin
    return limit if states.update <= limit else -1


def predicted_plan(profile: ActivationProfile, states: ModelStates, choices: tuple[str, ...],
                   rates: Rates, budget: int) -> Optional[PlanResult]:
    seconds = {c: choice_seconds(profile, rates, c) for c in choices}
    limit = activation_limit(profile, states, choices, budget)
    plan = solve(profile, limit, choices, seconds)
    if plan is None:
        return None
    uniform = {}
    for c in choices:
        pred = predict(profile, states, (c,) * profile.num_layers)
        uniform[c] = {"peak_gib": gib(pred.peak), "seconds": seconds[c] * profile.num_layers,
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


def what_fits(profile: ActivationProfile, ds_config: dict, target: Target, choices: tuple[str, ...],
              budget: int) -> tuple[float, str]:
    """(smallest achievable peak in GiB, what would fit: micro-batch, GPUs, ZeRO stage, offload)."""
    from .ds_config import zero_stage

    def fits(prof: ActivationProfile, states: ModelStates) -> bool:
        return feasible(prof, activation_limit(prof, states, choices, budget), choices) is not None

    states = model_states(profile, ds_config, target)
    act, plan = smallest_peak(profile, choices)
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


def auto_plan(recipe, ds_config: dict, world_size: int, config=None, target: Optional[Target] = None,
              rates: Optional[Rates] = None) -> tuple[ac.ACPlan, PlanResult]:
    """`activation_checkpointing.policy: auto`: the ACPlan that fits `memory_budget` with the least
    predicted step time. Raises UserError (one line) when no plan fits."""
    from .ds_config import ac_section
    from .memory_model import make_target, measure_rates, model_and_config, profile_activations

    section = recipe.activation_checkpointing
    if section.memory_budget is None:
        raise UserError("activation_checkpointing.memory_budget: policy 'auto' needs a budget in GiB "
                        "(the predicted peak device memory per GPU must fit it)")
    budget = int(section.memory_budget * (1 << 30))
    target = target or make_target(recipe, ds_config, world_size)
    config = config or model_and_config(recipe)
    ds_ac = ac_section(ds_config)
    backend = ac.resolve_backend(section.backend, ds_ac)
    profile = profile_activations(config, target)
    states = model_states(profile, ds_config, target)
    rates = rates or measure_rates(target.dtype)
    offload = target.device == "cuda" and rates.host_bytes_per_s > 0 and ds_ac["cpu_checkpointing"]
    choices = available_choices(profile, backend, offload)
    result = predicted_plan(profile, states, choices, rates, budget)
    if result is None:
        peak, hint = what_fits(profile, ds_config, target, choices, budget)
        raise UserError(f"activation_checkpointing.memory_budget: nothing fits {section.memory_budget:g} GiB "
                        f"per device: the smallest achievable predicted peak is {peak:.3f} GiB "
                        f"(model states {gib(states.total):.3f} GiB); would fit: {hint}")
    plan = ac.ACPlan(policy="auto", layers=result.modes, backend=backend, op_save=tuple(section.op_save),
                     cpu_checkpointing=ds_ac["cpu_checkpointing"], offload=result.offload,
                     partition_activations=ds_ac["partition_activations"] and backend == "deepspeed")
    return plan, result


def suggest_fit(recipe, ds_config: dict, world_size: int, budget_bytes: int) -> str:
    """For an out-of-memory report: the smallest peak memtrain's AC can reach, and what would fit."""
    from .ds_config import ac_section
    from .memory_model import make_target, model_and_config, profile_activations

    target = make_target(recipe, ds_config, world_size)
    profile = profile_activations(model_and_config(recipe), target)
    backend = ac.resolve_backend(recipe.activation_checkpointing.backend, ac_section(ds_config))
    choices = available_choices(profile, backend, offload=False)
    peak, hint = what_fits(profile, ds_config, target, choices, budget_bytes)
    if peak * (1 << 30) <= budget_bytes:
        return (f"predicted: activation_checkpointing.policy=auto with memory_budget={gib(budget_bytes):.1f} "
                f"fits (smallest predicted peak {peak:.2f} GiB)")
    return f"predicted smallest peak with any AC plan {peak:.2f} GiB > {gib(budget_bytes):.1f} GiB; would fit: {hint}"

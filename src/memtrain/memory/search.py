"""The whole-configuration search: every ZeRO stage, offload, TP, SP, micro-batch and recompute plan, scored.

For a recipe on `nodes` nodes of a hardware sheet and a fixed number of tokens per optimizer step
(global tokens = micro-batch x sequence x gradient accumulation x data-parallel ranks), it enumerates

  TP (AutoTP: divides the GPUs of a node, the heads and the KV heads)
  x SP (Ulysses: divides the world, the heads and the sequence; memtrain runs TP or SP, not both)
  x activation offload (the JSON's cpu_checkpointing: on or off)
  x ZeRO stage 0-3 x offload_optimizer (stage >= 1) x offload_param (stage 3)
  x micro-batch (gradient accumulation follows from the global batch)

and for each the per-layer recompute/offload plan of `memtrain.memory.planner.solve` (exact, the
solver `policy: auto` runs) under the GPU budget. Each configuration's target, model states and
peak come from the memory model the trainer and `make plan` use (`make_target`, `model_states`,
`predict`); its step time from `memtrain.memory.step_time`. The activation profile is measured once
per (TP, SP, offload) family at micro-batch 1 and scaled (activations are linear in the batch).
What cannot run is dropped with its reason counted. One configuration's score: memtrain.memory.score;
its JSON and recipe: memtrain.memory.plan_files.
"""
from __future__ import annotations

import bisect
import copy
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from memtrain.memory.flops import model_flops_per_token
from memtrain.model.build import build_on_meta
from memtrain.memory.hardware import Hardware
from memtrain.memory.plan_files import family_ds, family_recipe, variant_ds
from memtrain.memory.planner import activation_limit, choice_seconds, solve
from memtrain.memory.predict import LayerChoice, predict
from memtrain.memory.profile import ActivationProfile
from memtrain.memory.rates import Rates
from memtrain.memory.score import Family, Scored, Setting, make_family, parsed_zero, profile_of, score, sheet_rates
from memtrain.memory.states import ModelStates, model_states
from memtrain.memory.target import model_and_config

# The GPU budget when none is given: this share of the sheet's memory (CUDA's context, the
# allocator's fragmentation, which max_memory_allocated does not show, live in the rest).
MEMORY_HEADROOM = 0.95
# The host budget: this share of a node's RAM for its ranks' offloaded states and activations.
HOST_HEADROOM = 0.8
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# (stage, offload_optimizer, offload_param): what DeepSpeed accepts
ZERO_VARIANTS = ((0, False, False), (1, False, False), (1, True, False), (2, False, False), (2, True, False),
                 (3, False, False), (3, True, False), (3, False, True), (3, True, True))


@dataclass
class SearchResult:
    scored: list[Scored]  # best first
    dropped: Counter = field(default_factory=Counter)  # reason -> configurations dropped for it
    world: int = 0
    budget: int = 0
    host_budget: int = 0
    global_tokens: int = 0
    base_ds: dict = field(default_factory=dict)
    rates: Optional[Rates] = None  # the per-layer solver's (the sheet's)

    @property
    def considered(self) -> int:
        return len(self.scored) + sum(self.dropped.values())


def _layout_reason(recipe, config, world: int, tp: int, sp: int, sp_ok) -> Optional[str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if tp > 1 and sp > 1:
        return "TP and SP together (memtrain runs AutoTP or Ulysses, not both)"
    if heads % tp or kv % tp:
        return f"TP does not divide the attention heads ({heads}) and KV heads ({kv})"
    if tp > 1 and recipe.model.lora is not None:
        return "TP with model.lora (memtrain refuses AutoTP over peft's layers)"
    if sp > 1 and recipe.model.quantization is not None:
        return "SP with model.quantization (memtrain refuses Ulysses over a 4-bit base: untested)"
    if heads % sp:
        return f"SP does not divide the attention heads ({heads})"
    if recipe.data.seq_len % sp:
        return f"SP does not divide the sequence ({recipe.data.seq_len})"
    if sp > 1 and sp_ok is not None and sp not in sp_ok:
        return "SP: the model's attention cannot run Ulysses (memtrain.train.sequence_parallel.check)"
    return None


def layouts(recipe, config, world: int, gpus_per_node: int, sp_ok=None):
    """(tp, sp, activation offload, reason or None) for every family."""
    for tp in (d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and world % d == 0):
        for sp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            reason = _layout_reason(recipe, config, world, tp, sp, sp_ok)
            for activation_offload in (False, True):
                yield tp, sp, activation_offload, reason


_META_MODELS: dict = {}  # (model section, config) -> the model on the meta device, its largest parameter's elements


def _meta_model(recipe, config) -> tuple[object, int]:
    """The recipe's model on the meta device and its largest parameter's elements, built once per process for its
    model section and config (as the activation profiles are measured once: `memtrain.memory.profile`). Built from
    a copy: transformers writes into the config it builds from (its dtype), which would change the profiles' cache
    key. No search changes it."""
    key = (recipe.model.model_dump_json(), config.to_json_string())
    if key not in _META_MODELS:
        model = build_on_meta(recipe.model, copy.deepcopy(config))
        _META_MODELS[key] = model, max(p.numel() for p in model.parameters())
    return _META_MODELS[key]


def best_plan(profile: ActivationProfile, states: ModelStates, choices: tuple[LayerChoice, ...],
              s: Setting, solved: Optional[list] = None, fam: Optional[Family] = None) -> Optional[tuple[LayerChoice, ...]]:
    """The per-layer plan `policy: auto` picks under the budget (the exact solver), or None if none fits.
    Keeping every layer costs no time: where it fits it is the solver's answer, found without the DP.
    `solved` holds (limit, plan, what the plan needs) of earlier solves of this profile and ZeRO-1/2 reduce
    buffers: a plan optimal under a larger limit stays optimal under a smaller one that it still fits, and
    nothing fits a smaller limit than one where nothing fitted."""
    keep = (LayerChoice("keep"),) * profile.num_layers
    walk = (lambda plan: fam.predict(profile.target.micro_batch_size, states, plan)) if fam else (
        lambda plan: predict(profile, states, plan))
    if LayerChoice("keep") in choices and walk(keep).peak <= s.budget:
        return keep
    limit = activation_limit(profile, states, choices, s.budget)
    for larger, plan, need in solved if solved is not None else ():
        if limit <= larger and (plan is None or need <= limit):
            return plan
    seconds = fam.seconds_at(profile.target.micro_batch_size, s.rates) if fam else {
        c: choice_seconds(profile, s.rates, c) for c in choices}
    plan = solve(profile, limit, choices, seconds, backward_extra=states.backward, reduction=states.reduction,
                 release=states.release)
    if solved is not None:
        pred = None if plan is None else walk(plan)
        solved.append((limit, plan, None if pred is None else pred.activation_peak + pred.reduce_buffers - pred.released))
    return plan


def _variant(s: Setting, fam: Family, config, variant, ds: dict, states: ModelStates, micro_batches,
             result: SearchResult, solved: dict) -> None:
    """Score every micro-batch of one ZeRO variant of a family (its JSON `ds`, its model states), or count why not."""
    stage, offload_opt, offload_param = variant
    if fam.sp > 1 and stage == 0:
        result.dropped["SP with ZeRO-0 (Ulysses needs ZeRO >= 1)"] += len(micro_batches)
        return
    if offload_param and fam.target.quantization is not None:
        result.dropped["offload_param with model.quantization (memtrain refuses it: untested)"] += len(micro_batches)
        return
    if s.ranks_per_node * states.host > s.host_budget:
        result.dropped["host RAM per node exceeded by the ranks' offloaded model states"] += len(micro_batches)
        return
    dp = s.layout_world // (fam.tp * fam.sp)
    too_big = set()  # the model states (accumulating or not) under which a smaller micro-batch found no plan
    accumulating = None
    for mb in micro_batches:
        ga, rest = divmod(s.global_tokens, mb * s.seq_len * dp)
        if rest or ga < 1:
            result.dropped["global batch not reachable (tokens not a multiple of micro-batch x seq x DP)"] += 1
            continue
        # ZeRO-1/2 hold more between micro-steps when they accumulate (memory.states.accumulation); any count
        # above 1 holds the same, so one more set of states per variant
        if ga > 1 and stage in (1, 2):
            accumulating = accumulating or model_states(fam.profile, ds, replace(fam.target, grad_accum=ga),
                                                        parsed_zero(ds, s.memo))
            mb_states = accumulating
        else:
            mb_states = states
        plan = None if id(mb_states) in too_big else best_plan(
            fam.profile_at(mb), mb_states, fam.choices, s, solved.setdefault((mb, mb_states.backward_terms), []), fam)
        if plan is None:  # activations grow with the micro-batch: every larger one under these states fails too
            too_big.add(id(mb_states))
            result.dropped["GPU memory exceeded (no per-layer plan fits)"] += 1
            continue
        if fam.activation_offload and not any(c.offload for c in plan):
            result.dropped["activation offload on, but no layer offloaded (same as off)"] += 1
            continue
        scored = score(s, fam, config, ds, mb_states, stage, offload_opt, offload_param, mb, ga, plan)
        if scored.host_per_node > s.host_budget:
            result.dropped["host RAM per node exceeded by the ranks' offloads"] += 1
            continue
        result.scored.append(scored)


def search(recipe, base_ds: dict, hw: Hardware, nodes: int, global_tokens: int, budget: Optional[int] = None,
           host_budget: Optional[int] = None, sp_ok=None, micro_batches=MICRO_BATCHES,
           progress: Optional[Callable] = None, exact_top: int = 10) -> SearchResult:
    """Every configuration of `recipe` on `nodes` nodes of `hw` for `global_tokens` per step, best first.
    `sp_ok`: the SP sizes the model's attention allows (None: any); `progress` wraps the family loop (a bar);
    the best `exact_top` are scored again on profiles measured at their own micro-batch (`refine`)."""
    world = nodes * hw.gpus_per_node
    config = model_and_config(recipe)
    budget = budget or int(hw.gpu_memory * MEMORY_HEADROOM)
    host_budget = host_budget or int(hw.host_ram * HOST_HEADROOM)
    rates = sheet_rates(hw)
    s = Setting(hw, world, recipe.data.seq_len, global_tokens, budget, host_budget,
                model_flops_per_token(config, recipe.data.seq_len), rates)
    result = SearchResult([], Counter(), world, budget, host_budget, global_tokens, base_ds, rates)
    per_family = len(ZERO_VARIANTS) * len(micro_batches)
    items = list(layouts(recipe, config, world, hw.gpus_per_node, sp_ok))
    meta, s.memo["largest_param"] = _meta_model(recipe, config)  # one model for every family's recompute spec
    for tp, sp, activation_offload, reason in (progress(items) if progress else items):
        if reason:
            result.dropped[reason] += per_family
            continue
        fam = make_family(recipe, base_ds, config, world, tp, sp, activation_offload, rates, meta, s.memo)
        if fam is None:
            result.dropped["activation offload: no layer can offload (needs full recompute)"] += per_family
            continue
        solved: dict = {}  # (micro-batch, ZeRO-1/2 reduce buffers) -> solves, largest limits first:
        for variant, ds, states in _variants_by_size(fam, s.memo):
            _variant(s, fam, config, variant, ds, states, micro_batches, result, solved)
    result.scored.sort(key=rank_key)
    refine(s, config, result, exact_top)
    return result


def _variants_by_size(fam: Family, memo: dict) -> list[tuple[tuple, dict, ModelStates]]:
    """(variant, its JSON, its model states) of every ZeRO variant, smallest model states first: the per-layer
    solves then run largest activation limit first, which `best_plan`'s reuse needs. Each computed once; each ZeRO
    section parsed once per search (`memo`)."""
    out = []
    for variant in ZERO_VARIANTS:
        ds = variant_ds(fam.ds, *variant)
        out.append((variant, ds, model_states(fam.profile, ds, fam.target, parsed_zero(ds, memo))))
    return sorted(out, key=lambda v: v[2].total)


def rank_key(x: Scored) -> tuple:
    """Best first: more tokens/s, then fewer micro-steps (a larger micro-batch), then a lower peak, then fewer
    offloads and a lower ZeRO stage (the simpler run of two equal ones). The time model prices a micro-step's compute
    at one efficiency, so micro-batches of one global batch often tie; measured on an H100 they do not: micro-batch 1
    ran at 17% MFU, 2 at 28%, 8 at 31-33%, and on one rank ZeRO-1/2 added 20/65 ms a micro-step over ZeRO 0
    (reports/readme/plan-verify-h100.md). Ranking the lower peak first had put the slowest on top."""
    c = x.config
    return (-x.tokens_per_s, c.grad_accum, x.peak, c.offload_optimizer + c.offload_param + c.activation_offload,
            c.zero_stage)


def refine(s: Setting, config, result: SearchResult, top: int) -> None:
    """Score the best `top` again on profiles measured at their own micro-batch (scaling from micro-batch 1
    is close, not exact: rotary tables and block rounding do not scale), so that what the table shows and
    the winner's files run are what `make plan` predicts for them; re-rank."""
    done = 0
    while done < min(top, len(result.scored)):
        x = result.scored[done]
        if x.exact:
            done += 1
            continue
        fam = x.family
        mb = x.config.micro_batch
        exact = replace(fam, profile=profile_of(config, replace(fam.target, micro_batch_size=mb), s.memo))
        plan = best_plan(exact.profile, x.states, fam.choices, s)
        result.scored.pop(done)
        if plan is None or (fam.activation_offload and not any(c.offload for c in plan)):
            result.dropped["GPU memory exceeded (no per-layer plan fits; profile measured at its micro-batch)"] += 1
            continue
        c = x.config
        again = score(s, exact, config, x.ds, x.states, c.zero_stage, c.offload_optimizer, c.offload_param, mb,
                      c.grad_accum, plan)
        if again.host_per_node > s.host_budget:
            result.dropped["host RAM per node exceeded by the ranks' offloads"] += 1
            continue
        keys = [rank_key(y) for y in result.scored]
        result.scored.insert(bisect.bisect_left(keys, rank_key(again)), again)


def family_of(result: SearchResult, recipe, best: Scored) -> tuple[dict, object]:
    """The DeepSpeed JSON and recipe that run `best` (batch keys left "auto": the recipe fills them)."""
    c = best.config
    ds = variant_ds(family_ds(result.base_ds, c.tp, c.activation_offload), c.zero_stage, c.offload_optimizer,
                    c.offload_param)
    r = family_recipe(recipe, c.sp, c.micro_batch, c.grad_accum, result.budget / (1 << 30))
    return ds, r

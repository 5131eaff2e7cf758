"""One configuration of the whole-configuration search, scored: peak GPU memory, host memory per node, step time.

Its peak comes from the memory model `make plan` and the trainer use (`memtrain.memory.predict` on the
configuration's own target and model states); its collectives from `memtrain.memory.comm_volume`; the ops its
recompute dispatches again from `memtrain.memory.recompute_ops`; its step time from `memtrain.memory.step_time`, at
the hardware sheet's rates.
"""
from __future__ import annotations

import copy
import json

from dataclasses import dataclass, field, replace
from typing import Optional

from memtrain.config.zero3 import resident
from memtrain.memory.comm_volume import Layout, ModelShape, step_collectives
from memtrain.memory.hardware import Hardware
from memtrain.memory.plan_files import family_ds, family_recipe
from memtrain.memory.planner import available_choices, choice_seconds, may_offload
from memtrain.memory.predict import LayerChoice, Prediction, predict
from memtrain.memory.profile import ActivationProfile, profile_activations
from memtrain.memory.rates import Rates
from memtrain.memory.recompute_ops import recompute_ops
from memtrain.memory.states import ModelStates, keeps_gathered, persistent_elements, zero_config
from memtrain.memory.step_time import StepTime, optimizer_seconds, step_time
from memtrain.memory.target import Target, make_target, resolve_spec
from memtrain.memory.tensor_parallel import supports


@dataclass(frozen=True)
class Config:
    """The eight choices of one configuration."""

    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    tp: int
    sp: int
    micro_batch: int
    grad_accum: int
    activation_offload: bool  # the JSON's cpu_checkpointing (the plan may offload checkpointed inputs)

    def label(self) -> str:
        off = "+".join(n for n, on in (("opt", self.offload_optimizer), ("param", self.offload_param)) if on)
        return (f"z{self.zero_stage}" + (f" off:{off}" if off else "") + f" tp{self.tp} sp{self.sp} "
                f"mb{self.micro_batch} ga{self.grad_accum}" + (" act-off" if self.activation_offload else ""))


@dataclass
class Scored:
    config: Config
    layers: tuple[LayerChoice, ...]  # the per-layer recompute/offload plan
    prediction: Prediction
    host_per_node: int
    time: StepTime
    tokens_per_s: float
    mfu: float
    family: Optional["Family"] = None  # what re-scoring it needs
    ds: Optional[dict] = None
    states: Optional[ModelStates] = None
    exact: bool = False  # scored on a profile measured at its own micro-batch (not scaled from 1)

    @property
    def peak(self) -> int:
        return self.prediction.peak


@dataclass(frozen=True)
class Family:
    """What a (TP, SP, activation offload) family shares: its JSON, recipe, target, profile and choices."""

    tp: int
    sp: int
    activation_offload: bool
    ds: dict
    recipe: object
    target: Target
    profile: ActivationProfile
    choices: tuple[LayerChoice, ...]
    # aten ops each mode's recompute dispatches again (memtrain.memory.recompute_ops): counted where the sheet prices
    # them (host_op_s > 0), else empty
    ops: dict = field(default_factory=dict, compare=False)
    # what its configurations share, computed once: profiles by micro-batch, a ZeRO variant's collective facts
    cache: dict = field(init=False, default_factory=dict, compare=False, repr=False)

    def profile_at(self, micro_batch: int) -> ActivationProfile:
        """The profile at `micro_batch`: the measured one, or scaled from it (once per micro-batch)."""
        key = ("profile", micro_batch)
        if key not in self.cache:
            same = self.profile.target.micro_batch_size == micro_batch
            self.cache[key] = self.profile if same else self.profile.scaled(micro_batch)
        return self.cache[key]

    def seconds_at(self, micro_batch: int, rates: Rates) -> dict[LayerChoice, float]:
        """`planner.choice_seconds` of each choice at `micro_batch` (once per micro-batch and rates)."""
        key = ("seconds", micro_batch, rates)
        if key not in self.cache:
            profile = self.profile_at(micro_batch)
            self.cache[key] = {c: choice_seconds(profile, rates, c, self.ops) for c in self.choices}
        return self.cache[key]

    def predict(self, micro_batch: int, states: ModelStates, plan: tuple[LayerChoice, ...]) -> Prediction:
        """`memtrain.memory.predict` of a plan at `micro_batch`. Its activation terms depend on the model states
        only through their ZeRO-1/2 reduce buffers, so they are walked once per (micro-batch, buffers, plan)."""
        key = ("predict", micro_batch, states.backward_terms, plan)
        if key not in self.cache:
            self.cache[key] = predict(self.profile_at(micro_batch), states, plan)
        out = copy.copy(self.cache[key])
        out.model_states = states
        return out


def sheet_rates(hw: Hardware) -> Rates:
    """The per-layer solver's rates from the sheet (not this machine's)."""
    return Rates(hw.flops_per_s, hw.hbm_bytes_per_s * hw.hbm_efficiency, hw.host_bytes_per_s, "cuda", hw.host_op_s)


def make_family(recipe, base_ds: dict, config, world: int, tp: int, sp: int, activation_offload: bool,
                rates: Rates, model=None, memo: Optional[dict] = None) -> Optional[Family]:
    """A family's JSON, recipe, target, profile and choices. `model`: the recipe's model on the meta device, built
    once for all families (none of their choices changes it); default: built here. `memo`: what one search's
    families share (`Setting.memo`: the model's largest parameter, profiles by target); default: nothing."""
    memo = {} if memo is None else memo
    ds = family_ds(base_ds, tp, activation_offload)
    r = family_recipe(recipe, sp)
    spec = resolve_spec(r, ds, world, "cuda", model=model, largest_param=memo.get("largest_param"))[0]
    target = make_target(r, ds, world, spec=spec)
    profile = profile_of(config, target, memo)
    choices = available_choices(profile, spec.backend, may_offload(spec, target, rates))
    if activation_offload and not any(c.offload for c in choices):
        return None
    return Family(tp, sp, activation_offload, ds, r, target, profile, choices, ops_of(config, target, choices, rates, memo))


def ops_of(config, target: Target, choices: tuple[LayerChoice, ...], rates: Rates, memo: dict) -> dict:
    """The aten ops each choice's mode recomputes (`recompute_ops`), once per target in the search's memo; none
    counted where the rates do not price them."""
    if not rates.host_op_s:
        return {}
    modes = tuple(dict.fromkeys(c.mode for c in choices))
    key = ("ops", target, modes)
    if key not in memo:
        held = memo.get(("config json", id(config)))  # the config's JSON (the key's costly part) once a search
        if held is None or held[0] is not config:
            held = memo[("config json", id(config))] = config, config.to_json_string()
        memo[key] = recompute_ops(config, target, modes, held[1])
    return memo[key]


def profile_of(config, target: Target, memo: dict) -> ActivationProfile:
    """`profile_activations` of one search's `config` at `target`, looked up once per target in the search's memo."""
    key = ("profile", target)
    if key not in memo:
        memo[key] = profile_activations(config, target)
    return memo[key]


def parsed_zero(ds: dict, memo: dict):
    """DeepSpeed's parse of `ds`'s zero_optimization section (`states.zero_config`), once per section text in a
    search's memo: the families' JSONs differ outside it."""
    key = ("zero", json.dumps(ds.get("zero_optimization") or {}, sort_keys=True, default=str))
    if key not in memo:
        memo[key] = zero_config(ds)
    return memo[key]


def model_shape(config, profile: ActivationProfile, target: Target, persistent: int) -> ModelShape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads

    return ModelShape(text.num_hidden_layers, text.hidden_size, text.vocab_size, heads,
                      getattr(text, "num_key_value_heads", None) or heads,
                      getattr(text, "head_dim", None) or text.hidden_size // heads, profile.num_params, persistent,
                      target.trained(profile.num_params),
                      target.tp > 1 and not getattr(text, "tie_word_embeddings", False) and supports(text),
                      profile.replicated, target.trained(profile.replicated))


_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Setting:
    """What every configuration of one search shares."""

    hw: Hardware
    layout_world: int
    seq_len: int
    global_tokens: int
    budget: int
    host_budget: int
    flops_per_token: float  # the model's training FLOPs per token (no recompute)
    rates: Rates
    # what the search computes once for all its families: profiles by target, ZeRO sections parsed, ...
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def ranks_per_node(self) -> int:
        return min(self.layout_world, self.hw.gpus_per_node)


def _zero_facts(s: Setting, fam: Family, config, ds: dict, stage: int, layout: Layout) -> tuple[int, ModelShape, int, bool]:
    """(persistent elements, model shape, gathers per micro-step, resident) of a family's ZeRO variant: the same
    for all its micro-batches (the parameters do not change with the batch), so computed once per JSON."""
    same = fam.cache.get(("zero-json", id(ds)))  # the JSON itself kept in the memo: its id is not reused
    if same is None or same[0] is not ds:
        same = ds, json.dumps(ds.get("zero_optimization", {}), sort_keys=True, default=str)
        fam.cache[("zero-json", id(ds))] = same
    key = ("zero", stage, same[1])
    if key not in fam.cache:
        zero = parsed_zero(ds, s.memo)
        persistent = persistent_elements(fam.profile, zero) if stage == 3 else 0
        if ("shape",) not in fam.cache:  # the model's shape on one TP rank; ZeRO-3 adds its persistent elements
            fam.cache[("shape",)] = model_shape(config, fam.profile, fam.target, 0)
        shape = replace(fam.cache[("shape",)], persistent=persistent) if persistent else fam.cache[("shape",)]
        gathers = 1 if keeps_gathered(zero, fam.profile.num_params, layout.zero) else 2
        fam.cache[key] = persistent, shape, gathers, resident(ds, layout.zero)
    return fam.cache[key]


def _seconds_of(fam: Family, profile: ActivationProfile, rates: Rates):
    """choice -> `planner.choice_seconds` on `profile`: the family's memo where `profile` is its own at that
    micro-batch (a refined configuration's measured profile is computed afresh)."""
    mb = profile.target.micro_batch_size
    if fam.profile_at(mb) is profile:
        return fam.seconds_at(mb, rates).__getitem__
    return lambda c: choice_seconds(profile, rates, c, fam.ops)


def score(s: Setting, fam: Family, config, ds: dict, states: ModelStates, stage: int, offload_opt: bool,
          offload_param: bool, mb: int, ga: int, plan: tuple[LayerChoice, ...]) -> Scored:
    """Memory, host memory and step time of one configuration whose per-layer plan is `plan`."""
    profile = fam.profile_at(mb)
    layout = Layout(s.layout_world, s.hw.gpus_per_node, fam.tp, fam.sp)
    pred = fam.predict(mb, states, plan)
    elem = _ELEMENT[fam.target.dtype]
    persistent, shape, gathers, is_resident = _zero_facts(s, fam, config, ds, stage, layout)
    collectives = step_collectives(shape, stage, elem, layout, mb * fam.target.seq_len, tuple(c.mode for c in plan),
                                   gathers, is_resident)
    trained_rank = shape.trained // (layout.zero if stage >= 1 else 1)
    copies_micro = elem * shape.trained / layout.zero if offload_opt else 0.0
    if offload_param:
        copies_micro += elem * (shape.params - persistent) / layout.zero * gathers
    copies_step = elem * shape.params / layout.zero if offload_opt else 0.0
    time = step_time(s.hw, layout, collectives, s.flops_per_token * mb * s.seq_len / (fam.tp * fam.sp),
                     sum(map(_seconds_of(fam, profile, s.rates), plan)), ga,
                     optimizer_seconds(s.hw, trained_rank, offload_opt, s.ranks_per_node), copies_micro, copies_step,
                     tuple(c.mode for c in plan))
    tokens_per_s = s.global_tokens / time.seconds
    cfg = Config(stage, offload_opt, offload_param, fam.tp, fam.sp, mb, ga, fam.activation_offload)
    return Scored(cfg, plan, pred, s.ranks_per_node * (states.host + pred.host_activations), time, tokens_per_s,
                  s.flops_per_token * tokens_per_s / (s.layout_world * s.hw.peak_flops), fam, ds, states,
                  exact=profile.target.micro_batch_size == fam.profile.target.micro_batch_size)

"""Activation checkpointing (AC, recompute): policies -> per-layer plan -> checkpoint hooks.

A policy string becomes an `ACPlan`: one mode per decoder layer (`keep`, `full`, `attn`,
`mlp`, `op`), optional segments (consecutive `full` layers recomputed as one unit) and
optional module-path patterns. `apply_plan` installs any such plan on a transformers decoder
model whose layers are `GradientCheckpointingLayer`s:

* whole layers (`full`, `op`, segments) go through transformers' own per-layer hook
  (`layer.gradient_checkpointing` + `layer._gradient_checkpointing_func`), so module hooks
  such as ZeRO-3's parameter gathering stay outside the checkpoint;
* sublayers (`attn`, `mlp`) and pattern-matched modules get a checkpointed `forward`.

Each checkpointed unit runs through `checkpoint_function(plan, index)`:

* ``torch``: `torch.utils.checkpoint.checkpoint(use_reentrant=False)`; mode `op` adds
  `create_selective_checkpoint_contexts` (save matmul/attention outputs, recompute the rest);
* ``deepspeed``: `deepspeed.checkpointing.checkpoint` (reentrant), configured from the
  DeepSpeed JSON's `activation_checkpointing` section, which is inert without this.

Both backends restore the RNG state before a recompute, so recomputed dropout masks equal
the forward's.
"""
from __future__ import annotations

import functools
import math
import re
import types
import warnings as _warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .errors import UserError
from .metrics import current_activation_meter
from .offload import PREFETCH_DEPTH, ActivationOffloader, offload_flags, offload_units

KEEP, FULL, ATTN, MLP, OP = "keep", "full", "attn", "mlp", "op"
RECOMPUTE = FULL  # the base name for "recompute the whole layer"
LAYER_MODES = (KEEP, FULL, ATTN, MLP, OP)
_MARKS = {KEEP: ".", FULL: "R", ATTN: "A", MLP: "M", OP: "O"}
POLICY_HELP = ("none | full | every:K | first:N | sqrt | selective:attn | selective:mlp | op | modules | "
               "auto (per layer, under activation_checkpointing.memory_budget); "
               "full, sqrt, op and selective:* also take +first:N, and all but sqrt +every:K (e.g. op+first:4)")
_BASES = {"full": FULL, "sqrt": FULL, "op": OP, "selective:attn": ATTN, "selective:mlp": MLP}
# Attribute names of the attention / MLP sublayer across transformers decoder families.
_SUBLAYERS = {ATTN: ("self_attn", "attn", "attention", "self_attention"),
              MLP: ("mlp", "feed_forward", "ffn", "block_sparse_moe")}
DEFAULT_OP_SAVE = ("matmul", "attention")
OP_GROUPS = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_efficient_attention_forward"),
}


@dataclass(frozen=True)
class ACPlan:
    """What each decoder layer does in the backward, and how.

    `layers[i]` is one of LAYER_MODES. `segments` are half-open layer ranges `(start, stop)` of
    `full` layers recomputed as one unit (only the segment's input is kept). `modules` are
    module-path patterns (relative to the model) recomputed in addition. `op_save` is the
    save list of mode `op` (see `op_context_fn`).
    """

    policy: str
    layers: tuple[str, ...]
    backend: str  # "torch" | "deepspeed"
    segments: tuple[tuple[int, int], ...] = ()
    modules: tuple[str, ...] = ()
    op_save: tuple[str, ...] = DEFAULT_OP_SAVE
    cpu_checkpointing: bool = False
    partition_activations: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)
    offload: tuple[bool, ...] = ()  # per layer: the checkpoint call it makes sends its input to host
    offload_impl: str = "memtrain"  # who offloads: memtrain.offload, or DeepSpeed's own CPU_CHECKPOINT
    offload_skip_last: int = 1  # policy 'modules': the last N matched modules keep their input on the device

    @property
    def memtrain_offload(self) -> bool:
        """memtrain.offload runs (and DeepSpeed's CPU_CHECKPOINT must not)."""
        return self.cpu_checkpointing and self.offload_impl == "memtrain" and (any(self.offload) or bool(self.modules))

    @property
    def offload_units(self) -> tuple[int, ...]:
        """The layers that make one checkpoint call each (a recomputed layer, or a segment's head):
        the units `offload` chooses among. Policy 'modules' has none here: its units are the
        matched modules, known once the plan meets the model (`apply_plan`)."""
        return offload_units([m != KEEP for m in self.layers], self.segments)

    def _units_text(self, units) -> tuple[str, str]:
        """(what this plan's units are, which of them `units` are) for the description,
        e.g. ('segments', 'heads of layers 0,4')."""
        heads = {start for start, _ in self.segments}
        csv = lambda idx: ",".join(map(str, idx))  # noqa: E731
        every = self.offload_units
        if every and all(i in heads for i in every):
            return "segments", f"heads of layers {csv(units)}"
        if not any(i in heads for i in every):
            return "recomputed layers", f"layers {csv(units)}"
        seg, single = [i for i in units if i in heads], [i for i in units if i not in heads]
        return "checkpointed units", "; ".join(
            ([f"segments at layers {csv(seg)}"] if seg else []) + ([f"layers {csv(single)}"] if single else []))

    def _describe_offload(self) -> list[str]:
        if not self.cpu_checkpointing:
            return ["cpu_checkpointing: off"]
        units = self.offload_units
        noun, _ = self._units_text(units)
        if self.offload_impl == "deepspeed":
            what = f"{len(units)} {noun}" if not self.modules else f"every module matching {', '.join(self.modules)}"
            return [f"cpu_checkpointing: on, DeepSpeed's own CPU_CHECKPOINT copies the input of every checkpoint call "
                    f"({what}) (activation_checkpointing.cpu_checkpointing_impl: deepspeed)"]
        how = (f"(pinned host pool, side-stream copies, prefetch {PREFETCH_DEPTH} units ahead); "
               "DeepSpeed's own CPU_CHECKPOINT off")
        if self.modules:
            kept = self.offload_skip_last
            return [f"cpu_checkpointing: on, memtrain offload: inputs of the modules matching {', '.join(self.modules)} "
                    f"go to host memory" + (f", but the last {kept} in module order, which stay{'s' * (kept == 1)} on "
                                            "the device" if kept else "") + f" {how}"]
        flags = self.offload or (False,) * len(self.layers)
        host = [i for i in units if flags[i]]
        device = [i for i in units if not flags[i]]
        _, host_which = self._units_text(host)
        if not units:
            return ["cpu_checkpointing: on, but no layer is recomputed: nothing to offload"]
        if not device:
            stays = "none stays on the device"
        elif not host:
            stays = f"all {len(device)} stay on the device"
        elif device == list(units[len(units) - len(device):]):
            stays = f"the last {len(device)} stay{'s' * (len(device) == 1)} on the device"
        else:
            stays = f"{self._units_text(device)[1]} stay on the device"
        head = (f"cpu_checkpointing: on, memtrain offload: inputs of {len(host)} of {len(units)} {noun}"
                + (f" ({host_which})" if host else "") + f" go to host memory; {stays} {how}")
        starts = {s for s, _ in self.segments}
        stops = {e - 1 for _, e in self.segments}
        inside = {i for s, e in self.segments for i in range(s + 1, e)}
        marks = " ".join(("[" if i in starts else "")
                         + ("." if m == KEEP else "-" if i in inside else "H" if off else "D")
                         + ("]" if i in stops else "")
                         for i, (m, off) in enumerate(zip(self.layers, flags)))
        legend = "H = host, D = device, . = not recomputed" + (
            ", - = runs inside its segment's checkpoint; [...] = one segment" if self.segments else "")
        return [head, f"  checkpointed inputs ({legend}): {marks}"]

    def __post_init__(self) -> None:
        bad = sorted(set(self.layers) - set(LAYER_MODES))
        if bad:
            raise ValueError(f"ACPlan.layers: unknown modes {bad}; allowed: {LAYER_MODES}")
        if self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"ACPlan.backend: {self.backend!r}")
        end = 0
        for start, stop in sorted(self.segments):
            if not (end <= start and stop - start >= 2 and stop <= len(self.layers)):
                raise ValueError(f"ACPlan.segments: {self.segments} must be disjoint ranges of >= 2 layers")
            if any(m != FULL for m in self.layers[start:stop]):
                raise ValueError(f"ACPlan.segments: layers {start}..{stop - 1} of a segment must all be '{FULL}'")
            end = stop
        if OP in self.layers and self.backend == "deepspeed":
            raise UserError(f"activation_checkpointing.policy: '{self.policy}' uses op-level recompute, which needs "
                            "torch's non-reentrant checkpoint, but the backend is deepspeed; "
                            "set activation_checkpointing.backend: torch or choose another policy")

    @property
    def num_recomputed(self) -> int:
        return sum(mode != KEEP for mode in self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_marks(self) -> str:
        starts = {s for s, _ in self.segments}
        stops = {e - 1 for _, e in self.segments}
        return " ".join(("[" if i in starts else "") + _MARKS[m] + ("]" if i in stops else "")
                        for i, m in enumerate(self.layers))

    def describe(self) -> str:
        backend = {
            "torch": "torch.utils.checkpoint (non-reentrant)",
            "deepspeed": "deepspeed.checkpointing.checkpoint (reentrant)",
        }[self.backend]
        active = self.num_recomputed or self.modules
        lines = [
            f"AC plan: policy '{self.policy}', {self.num_recomputed}/{len(self.layers)} layers recomputed"
            + (f" with {backend}" if active else ""),
            "  layers (R = recompute, A = attention only, M = MLP only, O = op-level, . = keep; "
            f"[...] = one segment): {self.layer_marks()}",
        ]
        if OP in self.layers:
            lines.append(f"  op-level saves the outputs of: {', '.join(self.op_save)}")
        if self.modules:
            lines.append(f"  modules recomputed: {', '.join(self.modules)}")
        offload = self._describe_offload()
        lines.append(f"  partition_activations: {'on' if self.partition_activations else 'off'}; {offload[0]}")
        lines += offload[1:]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------- policy -> plan

def _policy_error(policy: str, why: str) -> UserError:
    return UserError(f"activation_checkpointing.policy: '{policy}': {why}; allowed: {POLICY_HELP}")


def _positive_int(text: str, policy: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) <= 0:
        raise _policy_error(policy, f"expected a positive integer after ':', got '{text}'")
    return int(text)


def _selected(selector: str, policy: str, num_layers: int) -> tuple[bool, ...]:
    name, sep, arg = selector.partition(":")
    if name == "first" and sep:
        n = _positive_int(arg, policy)
        return tuple(i < n for i in range(num_layers))
    if name == "every" and sep:
        k = _positive_int(arg, policy)
        return tuple(i % k == 0 for i in range(num_layers))
    raise _policy_error(policy, f"unknown layer selector '{selector}'")


def _parse(policy: str, num_layers: int) -> tuple[tuple[str, ...], bool]:
    """Per-layer modes of a policy string, and whether its layers are grouped into sqrt segments."""
    base, plus, selector = policy.strip().partition("+")
    if base in ("none", "modules"):
        if plus:
            raise _policy_error(policy, f"'{base}' takes no layer selector")
        return (KEEP,) * num_layers, False
    if base.startswith(("every:", "first:")) and not plus:
        return tuple(FULL if s else KEEP for s in _selected(base, policy, num_layers)), False
    if base not in _BASES:
        raise _policy_error(policy, "unknown policy")
    if base == "sqrt" and plus and not selector.startswith("first:"):
        raise _policy_error(policy, "sqrt segments are runs of consecutive layers; it composes with +first:N only")
    chosen = _selected(selector, policy, num_layers) if plus else (True,) * num_layers
    return tuple(_BASES[base] if s else KEEP for s in chosen), base == "sqrt"


def parse_policy(policy: str, num_layers: int) -> tuple[str, ...]:
    """Per-layer modes for a policy string."""
    return _parse(policy, num_layers)[0]


def sqrt_segments(layers: tuple[str, ...], segment_len: Optional[int] = None) -> tuple[tuple[int, int], ...]:
    """Split the leading run of recomputed layers into segments of ~sqrt(n) layers (Chen et al. 2016)."""
    n = next((i for i, m in enumerate(layers) if m == KEEP), len(layers))
    k = segment_len or max(1, round(math.sqrt(n)))
    return tuple((s, min(s + k, n)) for s in range(0, n, k) if min(s + k, n) - s >= 2)


def resolve_backend(requested: str, ds_ac: dict) -> str:
    """DeepSpeed's checkpoint when its JSON features are asked for, torch's otherwise."""
    if requested != "auto":
        return requested
    return "deepspeed" if ds_ac["partition_activations"] or ds_ac["cpu_checkpointing"] else "torch"


def effective_policy(section, ds_config: dict) -> str:
    """The JSON switches AC on (its activation_checkpointing section); the recipe says where."""
    if "activation_checkpointing" in ds_config:
        return section.policy
    if "policy" in section.model_fields_set and section.policy != "none":
        raise UserError(f"activation_checkpointing.policy: '{section.policy}' needs an activation_checkpointing "
                        "section in the DeepSpeed JSON, which has none (use e.g. ds_configs/zero3_ckpt.json)")
    return "none"


def build_plan(policy: str, backend: str, ds_ac: dict, num_layers: int, model_parallel_size: int = 1,
               section=None) -> ACPlan:
    """The plan for a policy string; `section` (the recipe's ACSection) supplies segment_len,
    modules and op_save (defaults without it)."""
    layers, is_sqrt = _parse(policy, num_layers)
    requested, backend = backend, resolve_backend(backend, ds_ac)
    segment_len = getattr(section, "segment_len", None)
    modules = tuple(getattr(section, "modules", ()) or ())
    op_save = tuple(getattr(section, "op_save", DEFAULT_OP_SAVE))
    base = policy.strip().partition("+")[0]
    warnings = []
    if ds_ac["partition_activations"] and model_parallel_size == 1:
        warnings.append("partition_activations shards checkpoints across the model-parallel group; "
                        "with no model parallelism (size 1) it shards nothing and saves no memory")
    if backend == "torch" and ds_ac["partition_activations"]:
        warnings.append("backend 'torch' ignores the JSON's partition_activations")
    offload_impl = getattr(section, "cpu_checkpointing_impl", "memtrain")
    if ds_ac["cpu_checkpointing"] and offload_impl == "deepspeed" and backend != "deepspeed":
        raise UserError("activation_checkpointing.cpu_checkpointing_impl: 'deepspeed' offloads inside DeepSpeed's "
                        "checkpoint only; set activation_checkpointing.backend: deepspeed (or auto)")
    if OP in layers and backend == "deepspeed":
        why = ("activation_checkpointing.backend is 'deepspeed'" if requested == "deepspeed" else
               "the DeepSpeed JSON asks for partition_activations/cpu_checkpointing, which selects DeepSpeed's "
               "reentrant checkpoint under backend 'auto'")
        raise UserError(f"activation_checkpointing.policy: '{policy}' (op-level) needs torch's non-reentrant "
                        f"checkpoint, but {why}; set activation_checkpointing.backend: torch or choose another policy")
    if base == "modules":
        if not modules:
            raise UserError("activation_checkpointing.modules: policy 'modules' needs a list of module-path "
                            "patterns, e.g. [model.layers.*.mlp]")
        if any(not p.strip() for p in modules):
            raise UserError("activation_checkpointing.modules: empty pattern")
    elif modules:
        warnings.append(f"activation_checkpointing.modules is ignored by policy '{policy}' (used by 'modules')")
        modules = ()
    if segment_len and not is_sqrt:
        warnings.append(f"activation_checkpointing.segment_len is ignored by policy '{policy}' (used by 'sqrt')")
    if OP in layers:
        op_rules(op_save)  # validate early: a bad entry fails before any distributed work
    segments = sqrt_segments(layers, segment_len) if is_sqrt else ()
    skip_last = getattr(section, "offload_skip_last", 1)
    return ACPlan(
        policy=policy,
        layers=layers,
        backend=backend,
        segments=segments,
        modules=modules,
        op_save=op_save,
        cpu_checkpointing=ds_ac["cpu_checkpointing"],
        partition_activations=ds_ac["partition_activations"] and backend == "deepspeed",
        warnings=tuple(warnings),
        offload=offload_flags([m != KEEP for m in layers], ds_ac["cpu_checkpointing"], skip_last,
                              every=offload_impl == "deepspeed", segments=segments),
        offload_impl=offload_impl,
        offload_skip_last=skip_last,
    )


# --------------------------------------------------------------------------- op-level (selective) recompute

def _resolve_ops(name: str, entry: str) -> frozenset:
    names = OP_GROUPS.get(name, (name.removeprefix("aten."),))
    ops = set()
    for qualified in names:
        packet_name, _, overload = qualified.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None) if packet_name.isidentifier() else None
        if packet is None:
            continue
        try:
            overloads = [overload] if overload else packet.overloads()
            ops.update(getattr(packet, o) for o in overloads)
        except AttributeError:
            continue
    if not ops:
        raise UserError(f"activation_checkpointing.op_save: unknown op '{entry}'; use matmul, attention "
                        "or an aten op name such as mul.Tensor, optionally with /N (every N-th call)")
    return frozenset(ops)


def op_rules(entries) -> list[tuple[frozenset, int]]:
    """`op_save` entries -> (ops, every): 'matmul', 'attention' or an aten op name, 'name/N' = every N-th."""
    rules = []
    for entry in entries:
        name, sep, every = str(entry).strip().partition("/")
        if sep and (not every.isdigit() or int(every) <= 0):
            raise UserError(f"activation_checkpointing.op_save: '{entry}': expected name/N with N a positive integer")
        rules.append((_resolve_ops(name.strip(), entry), int(every) if sep else 1))
    return rules


def _draws_random(func, args, kwargs) -> bool:
    """Ops that consume the RNG must be recomputed so the recompute draws the same numbers in order."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" in names:  # attention kernels are tagged seeded but draw only with dropout on
        i = names.index("dropout_p")
        return float(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)) > 0.0
    return True


def op_context_fn(entries) -> Callable:
    """`context_fn` for torch's checkpoint: save the outputs of the listed ops, recompute the rest.

    Counting for 'name/N' restarts at every checkpointed call (torchtitan's "every second
    matmul" is `matmul/2`: the 1st, 3rd, ... calls are saved).
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    rules = op_rules(entries)

    def context_fn():
        counts = [0] * len(rules)

        def policy(ctx, func, *args, **kwargs):
            if _draws_random(func, args, kwargs):
                return CheckpointPolicy.PREFER_RECOMPUTE
            for i, (ops, every) in enumerate(rules):
                if func in ops:
                    counts[i] += 1
                    return CheckpointPolicy.MUST_SAVE if (counts[i] - 1) % every == 0 \
                        else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = create_selective_checkpoint_contexts(policy)
        return _metered(caching), cached

    return context_fn


@contextmanager
def _metered(caching):
    """Selective checkpoint keeps saved op outputs in its own storage, not via autograd's
    saved-tensor hooks: report them to the activation meter."""
    with caching:
        yield
    meter = current_activation_meter()
    if meter is not None:
        # torch 2.13 keeps a dict per op, torch 2.11 (the GPU image's) a list; entries are
        # version wrappers (`.val`) or the tensors themselves
        meter.retain(getattr(w, "val", w) for entries in caching.storage.values()
                     for entry in (entries.values() if isinstance(entries, dict) else entries)
                     for w in tree_leaves(entry))


# --------------------------------------------------------------------------- checkpoint functions

# Set by `observe_recompute` (used by memtrain.ac_profile): a context-manager factory entered
# around every run of a checkpointed function while it is active.
_OBSERVER: Optional[Callable[[], ContextManager]] = None


@contextmanager
def observe_recompute(observer: Callable[[], ContextManager]):
    """Run every checkpointed function under `observer()`; active around a backward, it sees the recomputes."""
    global _OBSERVER
    previous, _OBSERVER = _OBSERVER, observer
    try:
        yield
    finally:
        _OBSERVER = previous


def _observed(function: Callable) -> Callable:
    def run(*args):
        observer = _OBSERVER
        if observer is None:
            return function(*args)
        with observer():
            return function(*args)

    return run


def _retain(args, kwargs) -> None:
    """Checkpoints keep their inputs (and the tensors bound into their function) alive outside
    autograd's saved tensors: report them to the activation meter."""
    meter = current_activation_meter()
    if meter is not None and torch.is_grad_enabled():
        meter.retain(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))


def _torch_checkpoint(function, *args, context_fn=None):
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=context_fn or torch.utils.checkpoint.noop_context_fn)


def checkpoint_function(plan: ACPlan, index: Optional[int] = None,
                        offloader: Optional[ActivationOffloader] = None, offload: Optional[bool] = None) -> Callable:
    """`fn(function, *args)` running one checkpointed unit of `plan`: layer `index` (its sublayer,
    or the segment it starts), or with `index=None` a pattern-matched module (mode full).
    With an `offloader`, the unit's checkpointed inputs are handed to it (offloaded when `offload`,
    by default `plan.offload[index]`; every unit schedules the prefetch of the ones before it)."""
    mode = plan.layers[index] if index is not None else FULL
    if plan.backend == "deepspeed":
        import deepspeed

        base = deepspeed.checkpointing.checkpoint
    elif mode == OP:
        base = functools.partial(_torch_checkpoint, context_fn=op_context_fn(plan.op_save))
    else:
        base = _torch_checkpoint

    def run(function, *args):
        _retain(args, getattr(function, "keywords", None))
        return base(_observed(function), *args)

    if offloader is None:
        return run
    if offload is None:
        offload = index is not None and plan.offload[index]
    return offloader.wrap(run, plan.backend, offload)


def configure_deepspeed_ac(ds_config: dict, plan: ACPlan) -> None:
    """Make the JSON's activation_checkpointing section take effect (DeepSpeed leaves it inert).
    DeepSpeed's own CPU_CHECKPOINT runs only when the plan says DeepSpeed offloads; otherwise the
    JSON's `cpu_checkpointing` is memtrain's (memtrain.offload) and DeepSpeed must not copy too."""
    import deepspeed

    ds_own = plan.cpu_checkpointing and plan.offload_impl == "deepspeed"
    ds_config = {**ds_config, "activation_checkpointing": {**ds_config.get("activation_checkpointing", {}),
                                                           "cpu_checkpointing": ds_own}}
    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)


# --------------------------------------------------------------------------- installing a plan

def _hidden(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _same(a, b) -> bool:
    (la, sa), (lb, sb) = tree_flatten(a), tree_flatten(b)
    return sa == sb and all(x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(la, lb))


class _Segment:
    """Layers [start, stop) recomputed as one unit. The first layer runs them all inside one
    checkpoint (so only the segment input is kept); the model's loop then calls the others,
    which pass the segment output through."""

    def __init__(self, layers: list, checkpoint: Callable) -> None:
        self.layers, self.checkpoint = layers, checkpoint
        self.inside = False
        # of the latest forward: (args after the hidden state, kwargs, the output's hidden-state
        # storage address and shape, the output's other elements or None for a bare tensor). Not
        # the output itself: it is the next unit's input, which offload must be able to free.
        self.last = None

    def _run(self, function, kwargs, *args):
        out = function(*args)
        self.inside = True
        try:
            for layer in self.layers[1:]:  # through __call__: module hooks (ZeRO-3 gathering) run
                out = layer(_hidden(out), *args[1:], **kwargs)
        finally:
            self.inside = False
        return out

    def head(self, function, *args):
        kwargs = function.keywords  # transformers passes partial(forward, layer, **kwargs)
        _retain((), kwargs)
        out = self.checkpoint(functools.partial(self._run, function, kwargs), *args)
        hidden = _hidden(out)
        self.last = (args[1:], kwargs, hidden.untyped_storage().data_ptr(), hidden.shape,
                     None if isinstance(out, torch.Tensor) else (type(out), tuple(out[1:])))
        return out

    def follower(self, function, *args):
        if self.inside:
            return function(*args)
        rest, kwargs, data_ptr, shape, others = self.last
        if not (_same(args[1:], rest) and _same(function.keywords, kwargs) and args[0].shape == shape
                and args[0].untyped_storage().data_ptr() == data_ptr):
            raise UserError("activation_checkpointing.policy: sqrt segments need the layers of a segment to get the "
                            "same arguments and each other's outputs unchanged; this model passes per-layer "
                            "arguments or changes hidden states between layers: use policy full or segment_len: 1")
        return args[0] if others is None else others[0]((args[0], *others[1]))


def _checkpointed_forward(self, *args, **kwargs):
    """`forward` of a recomputed sublayer/module. Every tensor goes in positionally: DeepSpeed's
    reentrant checkpoint only back-propagates into positional tensor arguments."""
    forward = functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    # the checkpoint keeps `run` for the recompute: it must not hold the tensors themselves (only
    # the checkpoint's own inputs, which offload can move to host and free on the device)
    template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    del leaves, args, kwargs

    def run(*given):
        it = iter(given)
        a, k = tree_unflatten([next(it) if t else x for x, t in zip(template, is_tensor)], spec)
        return forward(*a, **k)

    return self._ac_checkpoint(run, *tensors)


def _checkpoint_module(module: nn.Module, fn: Callable) -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    if isinstance(module, GradientCheckpointingLayer):
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = fn
    else:
        module._ac_checkpoint = fn
        module.forward = types.MethodType(_checkpointed_forward, module)


def _sublayer(layer: nn.Module, mode: str) -> nn.Module:
    for name in _SUBLAYERS[mode]:
        if isinstance(getattr(layer, name, None), nn.Module):
            return getattr(layer, name)
    raise UserError(f"activation_checkpointing.policy: {type(layer).__name__} has no {mode} sublayer named "
                    f"{' / '.join(_SUBLAYERS[mode])}; use policy 'modules' with module-path patterns")


def _pattern(text: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in text.strip().split("*")) + "$")


def _match_modules(model: nn.Module, patterns) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    hits = []
    for text in patterns:
        rx = _pattern(text)
        found = [n for n in names if rx.match(n)]
        if not found:
            examples = ", ".join(n for n in names if re.search(r"\.0\.[^.]+$", n))[:160]
            raise UserError(f"activation_checkpointing.modules: '{text}' matches no module of "
                            f"{type(model).__name__} ('*' is one path part; e.g. {examples})")
        hits += [n for n in found if n not in hits]
    return hits


def remove_plan(model: nn.Module) -> None:
    """Undo `apply_plan` (no layer or module recomputed)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = False
            module.__dict__.pop("_gradient_checkpointing_func", None)
        if module.__dict__.pop("_ac_checkpoint", None) is not None:
            module.__dict__.pop("forward", None)
    model.__dict__.pop("ac_offloader", None)


def _stateful_warnings(model: nn.Module, units: list[nn.Module]) -> list[str]:
    """BatchNorm-like modules update running statistics in every forward, recomputes included."""
    names = {id(m): n for n, m in model.named_modules()}
    found = {}
    for unit in units:
        for m in unit.modules():
            if getattr(m, "track_running_stats", False) and m.training:
                found[names[id(m)]] = type(m).__name__
    return [f"{n} ({kind}) updates running statistics in its forward; in a recomputed region every recompute "
            "updates them again" for n, kind in found.items()]


def apply_plan(model: nn.Module, plan: ACPlan) -> list[str]:
    """Install `plan` on a causal LM (or directly on its decoder-layer list), replacing any
    earlier plan. Returns (and emits as RuntimeWarning) warnings about stateful modules."""
    from .model import decoder_layers

    _, layers = decoder_layers(model)
    if len(layers) != len(plan.layers):
        raise ValueError(f"plan has {len(plan.layers)} layers, the model {len(layers)}")
    remove_plan(model)
    # memtrain's cpu_checkpointing: one offloader for the whole model (it orders the prefetches);
    # kept as `model.ac_offloader` for inspection
    offloader = model.ac_offloader = ActivationOffloader() if plan.memtrain_offload else None
    units = []
    for i, (layer, mode) in enumerate(zip(layers, plan.layers)):
        if mode in (FULL, OP):
            units.append(layer)
        elif mode in (ATTN, MLP):
            units.append(_sublayer(layer, mode))
        if mode != KEEP:
            _checkpoint_module(units[-1], checkpoint_function(plan, i, offloader))
    for start, stop in plan.segments:
        segment = _Segment(list(layers[start:stop]), checkpoint_function(plan, start, offloader))
        layers[start]._gradient_checkpointing_func = segment.head
        for layer in layers[start + 1:stop]:
            layer._gradient_checkpointing_func = segment.follower
    named = dict(model.named_modules())
    taken = {n for n, m in named.items() if any(m is u for u in units)}
    warnings, matched = [], []
    for name in _match_modules(model, plan.modules):
        outer = next((t for t in taken if name.startswith(t + ".") or t.startswith(name + ".")), None)
        if outer is not None:
            warnings.append(f"activation_checkpointing.modules: '{name}' overlaps '{outer}', "
                            "which is already recomputed; skipped")
            continue
        taken.add(name)
        matched.append(name)
    # each matched module is one offload unit; the last `offload_skip_last` in module order (the
    # forward's order in a decoder) keep their input on the device
    order = list(named)
    matched.sort(key=order.index)
    offloaded = max(len(matched) - plan.offload_skip_last, 0) if offloader is not None else 0
    for k, name in enumerate(matched):
        units.append(named[name])
        _checkpoint_module(named[name], checkpoint_function(plan, None, offloader, offload=k < offloaded))
    warnings += _stateful_warnings(model, units)
    for w in warnings:
        _warnings.warn(w, RuntimeWarning, stacklevel=2)
    return warnings

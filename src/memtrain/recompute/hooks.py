"""Recompute hooks: install an `ACPlan` on a transformers model (torch or DeepSpeed checkpoint, op-level SAC, offload).

`apply_plan` installs any such plan on a transformers decoder
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
the forward's. Under `train.compile` every layer runs through `memtrain.recompute.compiled`'s callables instead:
torch's checkpoint traced inside the compiled layer, DeepSpeed's and a sqrt segment's around it.
"""
from __future__ import annotations

import functools
import inspect
import re
import types
import warnings as _warnings
from contextlib import contextmanager
from typing import Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memtrain.errors import UserError
from memtrain.recompute.meter import current_activation_meter
from memtrain.config.recompute_spec import RecomputeSpec
from memtrain.recompute.policy import ATTN, FULL, KEEP, MLP, OP, SUBLAYER_NAMES, ACPlan, draws_random, op_rules
from memtrain.recompute.offload import ActivationOffloader
from memtrain.recompute.compiled import CompiledLayers, compiled_fn
from memtrain.model.build import decoder_layers
from memtrain.recompute import partition


def op_context_fn(entries) -> Callable:
    """`context_fn` for torch's checkpoint: save the outputs of the listed ops, recompute the rest.

    Counting for 'name/N' restarts at every checkpointed call (torchtitan's "every second
    matmul" is `matmul/2`: the 1st, 3rd, ... calls are saved).
    """
    rules = op_rules(entries)

    def context_fn():
        # torch 2.13 asks the policy in the forward only; older torch (2.11, the GPU image's) asks again in the
        # recompute (ctx.is_recompute), whose count must start where the forward's did
        counts = {False: [0] * len(rules), True: [0] * len(rules)}
        watch = _LastMatmul()  # 'but-last': the latest such call in the forward, and what its output feeds

        def policy(ctx, func, *args, **kwargs):
            recompute = bool(getattr(ctx, "is_recompute", False))
            if not recompute:
                watch.follow(func, args, kwargs, getattr(ctx, "op_output", None))
            if draws_random(func, args, kwargs):
                return CheckpointPolicy.PREFER_RECOMPUTE
            for i, (ops, every, but_last) in enumerate(rules):
                if func in ops:
                    counted = counts[recompute]
                    counted[i] += 1
                    if but_last and not recompute:
                        watch.start(func, getattr(ctx, "op_output", None))
                    return CheckpointPolicy.MUST_SAVE if (counted[i] - 1) % every == 0 \
                        else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = create_selective_checkpoint_contexts(policy)
        return _metered(caching, lambda: watch.drop_from(caching.storage)), cached

    return context_fn


_RESIDUAL_ADDS = frozenset({torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor})
_RESHAPES = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default,
                       torch.ops.aten.reshape.default})


class _LastMatmul:
    """op_save 'name/but-last': the unit's last matching call is not kept when all its output feeds (directly
    or through views) is additions: an add's backward needs neither operand, so the backward never asks for
    it and torch's early stop ends the recompute before it (a pre-norm layer's down_proj / c_proj into the
    residual). An output that feeds anything else (an MoE's router-weighted sum, a post-norm's LayerNorm)
    stays saved. Seen through the policy's `op_output` (torch 2.13); older torch keeps every call saved."""

    def __init__(self) -> None:
        self.func = None
        self.tensors: list[torch.Tensor] = []  # the output and its views (held until the unit's forward ends)
        self.only_adds = False

    def start(self, func, out) -> None:
        self.func = func
        self.tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.only_adds = bool(self.tensors)

    def follow(self, func, args, kwargs, out) -> None:
        if not self.tensors or not any(any(a is t for t in self.tensors) for a in tree_leaves((args, kwargs))
                                       if isinstance(a, torch.Tensor)):
            return
        if func in _RESHAPES or getattr(func, "is_view", False):
            self.tensors += [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        elif func not in _RESIDUAL_ADDS:
            self.only_adds = False

    def drop_from(self, storage) -> None:
        """At the end of the unit's forward: torch 2.13 keeps one dict per op, call index -> entry, and replays
        the decisions stored there, so the last call's entry becomes its recompute marker."""
        marker = getattr(checkpoint, "_RECOMPUTE", None)
        entries = storage.get(self.func) if self.func is not None else None
        if self.only_adds and marker is not None and isinstance(entries, dict) and entries:
            entries[max(entries)] = marker
        self.tensors = []


@contextmanager
def _metered(caching, on_exit: Callable[[], None] = lambda: None):
    """Selective checkpoint keeps saved op outputs in its own storage, not via autograd's
    saved-tensor hooks: report them to the activation meter (after `on_exit` edited the storage)."""
    with caching:
        yield
    on_exit()
    meter = current_activation_meter()
    if meter is not None:
        # torch 2.13 keeps a dict per op, torch 2.11 (the GPU image's) a list; entries are
        # version wrappers (`.val`) or the tensors themselves
        meter.retain(getattr(w, "val", w) for entries in caching.storage.values()
                     for entry in (entries.values() if isinstance(entries, dict) else entries)
                     for w in tree_leaves(entry))


# --------------------------------------------------------------------------- checkpoint functions

# Set by `observe_recompute` (used by memtrain.tools.ac_profile): a context-manager factory entered
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
                        offloader: Optional[ActivationOffloader] = None, offload: Optional[bool] = None,
                        compiled: Optional[CompiledLayers] = None) -> Callable:
    """`fn(function, *args)` running one checkpointed unit of `plan`: layer `index` (its sublayer,
    or the segment it starts), or with `index=None` a pattern-matched module (mode full).
    With an `offloader`, the unit's checkpointed inputs are handed to it (offloaded when `offload`,
    by default `plan.offload[index]`; every unit schedules the prefetch of the ones before it).
    With `compiled` (train.compile), a layer runs compiled: torch's checkpoint traced inside it, DeepSpeed's
    around it (memtrain.recompute.compiled)."""
    mode = plan.layers[index] if index is not None else FULL
    if compiled is not None and plan.backend == "torch":
        if mode in (ATTN, MLP):  # a sublayer: its checkpoint is traced inside its compiled layer
            return compiled.inner
        traced = compiled.op if mode == OP else compiled.full
        # no `_retain`: the compiled function saves the checkpoint's inputs with autograd, where the meter sees them
        return traced if offloader is None else offloader.wrap(
            traced, plan.backend, plan.offload[index] if offload is None else offload, inputs_only=True)
    if compiled is not None:  # DeepSpeed's (reentrant) checkpoint is eager: the layer's forward compiled inside it
        eager = checkpoint_function(plan, index, offloader, offload)
        return lambda function, *args: eager(functools.partial(compiled.forward, function), *args)
    if plan.backend == "deepspeed":
        import deepspeed  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        base = deepspeed.checkpointing.checkpoint if plan.deepspeed_reentrant else \
            deepspeed.checkpointing.non_reentrant_checkpoint
    elif mode == OP:
        base = functools.partial(_torch_checkpoint, context_fn=op_context_fn(plan.op_save))
    else:
        base = _torch_checkpoint

    def run(function, *args):
        _retain(args, getattr(function, "keywords", None))
        if plan.backend != "deepspeed":
            return base(_observed(function), *args)

        if partition.empties_inputs():  # the caller's tensors stay whole (output_hidden_states)
            args = partition.protect_inputs(args)
        out = base(_observed(function), *args)
        meter = current_activation_meter()
        if meter is not None and torch.is_grad_enabled():  # held by DeepSpeed itself: hooks never see it
            device = next((t.device for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            saved = partition.saved_by_deepspeed(args)
            meter.retain(t for t in saved if t.device == device)
            for t in saved:  # DeepSpeed's own CPU_CHECKPOINT: on the host, not the device
                if t.device != device:
                    meter.offloaded(t.untyped_storage().nbytes())
        return out

    if offloader is None:
        return run
    if offload is None:
        offload = index is not None and plan.offload[index]
    return offloader.wrap(run, plan.backend, offload)


def configure_deepspeed_ac(spec: RecomputeSpec, number_checkpoints: Optional[int], mpu=None) -> None:
    """Make the JSON's activation_checkpointing section take effect (DeepSpeed leaves it inert), with the
    values the run's RecomputeSpec decided: DeepSpeed's own CPU_CHECKPOINT only when DeepSpeed offloads
    (otherwise the JSON's `cpu_checkpointing` is memtrain's, memtrain.recompute.offload, and DeepSpeed must
    not copy too), partitioning only where it takes effect. Given as arguments, not as a config: DeepSpeed
    would build a whole DeepSpeedConfig from one and check its batch size against the mpu's data-parallel
    size. `mpu`: deepspeed.utils.groups when the run has a tensor-parallel group (memtrain.recompute.partition)."""
    import deepspeed  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    deepspeed.checkpointing.configure(mpu, **spec.deepspeed_kwargs(number_checkpoints))


# --------------------------------------------------------------------------- installing a plan

def _hidden(out):
    return out if isinstance(out, torch.Tensor) else out[0]


class _Segment:
    """Layers [start, stop) recomputed as one unit, each with its own arguments. The model's loop calls
    them in turn: every layer but the last records its arguments and passes the segment input through;
    the last runs them all inside one checkpoint (so only the segment input is kept), each layer with
    the arguments the loop gave it (Gemma-2's alternating sliding-window and full masks, Gemma-3's
    per-type rotary embeddings).

    A layer that returns a tuple (Falcon's (hidden, attention weights)) passes through a tuple of the
    same shape. Its forward's return annotation says which (`-> torch.Tensor` in most transformers 5
    families); where it does not, one forward of the head under no_grad (its RNG state restored) shows
    it, once per run. The model's loop only reads the hidden state of a layer it did not ask attention of."""

    def __init__(self, layers: list, checkpoint: Callable, forward: Callable) -> None:
        # forward(function, *args): how a layer's bound forward runs (compiled under train.compile)
        self.layers, self.checkpoint, self.forward = layers, checkpoint, forward
        self.inside = False
        self.input = None  # the segment input, while its layers are being called
        self.calls = []  # (function, arguments after the hidden state) of the layers called so far
        self.rest = None  # what a tuple-returning layer returns after its hidden state; () for a bare tensor

    def _run(self, calls, *args):
        self.inside = True
        try:
            out = None
            for layer, (function, rest) in zip(self.layers, calls):
                given = args if out is None else (_hidden(out), *rest)
                # all but the last through __call__: module hooks (ZeRO-3 gathering) run; the last is the
                # layer whose call runs the segment: its hooks already ran
                out = self.forward(function, *given) if layer is self.layers[-1] else \
                    layer(*given, **function.keywords)
        finally:
            self.inside = False
        return out

    def call(self, function, *args):
        if self.inside:
            return self.forward(function, *args)
        layer = function.args[0]  # transformers passes partial(forward, layer, **kwargs)
        if layer is self.layers[0]:
            self.calls, self.input = [], args[0]
        # a later layer gets what the one before passed through: the segment input, or (ZeRO-3's hooks wrap
        # module outputs) a tensor on its storage
        elif len(self.calls) >= len(self.layers) or layer is not self.layers[len(self.calls)] \
                or not _same_tensor(args[0], self.input):
            self.calls, self.input = [], None
            raise UserError("activation_checkpointing.policy: sqrt segments need the model to call a segment's "
                            "layers in order, each with the previous one's output unchanged; this model does not "
                            "(it changes hidden states between layers): use policy full or segment_len: 1")
        self.calls.append((function, args[1:]))
        if len(self.calls) < len(self.layers):
            if self.rest is None:
                self.rest = _output_rest(function, args)
            return args[0] if self.rest == () else (args[0], *self.rest)
        calls, self.calls, self.input = self.calls, [], None
        for later, rest in calls[1:]:
            _retain(rest, later.keywords)
        _retain((), calls[0][0].keywords)
        # the segment input as the last layer got it (through the pass-throughs: the backward reaches each
        # layer's module hooks, as without recompute) and the head's other arguments go in positionally (the
        # checkpoint keeps them, offload may move them); the other layers' arguments stay bound in `calls`,
        # as transformers binds keywords in `function`
        return self.checkpoint(functools.partial(self._run, calls), args[0], *calls[0][1])


def _same_tensor(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()


def _output_rest(function, args) -> tuple:
    """What a layer returns after its hidden state: () for a bare tensor, else the tuple's other elements
    (from its annotation, or a forward under no_grad with the RNG state restored so dropout draws stay those
    of the real run)."""
    if inspect.signature(function.func).return_annotation in (torch.Tensor, "torch.Tensor"):
        return ()
    devices = [t.device for t in args if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    with torch.no_grad(), torch.random.fork_rng(devices=devices[:1], device_type=devices[0].type if devices
                                                 else "cuda"):
        out = function(*args)
    return () if isinstance(out, torch.Tensor) else tuple(out[1:])


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
    from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415 transformers: heavy, imported only when this runs

    if isinstance(module, GradientCheckpointingLayer):
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = fn
    else:
        module._ac_checkpoint = fn
        module.forward = types.MethodType(_checkpointed_forward, module)


def find_sublayer(layer: nn.Module, mode: str) -> Optional[nn.Module]:
    """The layer's attention (mode 'attn') or MLP ('mlp') sublayer, or None where it has none by a known name
    (OPT's MLP is fc1/fc2 directly on the layer)."""
    return next((getattr(layer, name) for name in SUBLAYER_NAMES[mode]
                 if isinstance(getattr(layer, name, None), nn.Module)), None)


def sublayer(layer: nn.Module, mode: str) -> nn.Module:
    """The layer's attention or MLP sublayer (`find_sublayer`); one line naming its submodules if it has none."""
    found = find_sublayer(layer, mode)
    if found is not None:
        return found
    children = ", ".join(name for name, _ in layer.named_children())
    raise UserError(f"activation_checkpointing.policy: {type(layer).__name__} has no {mode} sublayer named "
                    f"{' / '.join(SUBLAYER_NAMES[mode])} (its submodules: {children}); every policy but "
                    f"selective:{mode} works, or policy 'modules' with module-path patterns of those")


def module_pattern(text: str) -> re.Pattern:
    """An `activation_checkpointing.modules` pattern as a regex: '*' stands for one part of a module path."""
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in text.strip().split("*")) + "$")


def _match_modules(model: nn.Module, patterns) -> list[str]:
    names = [n for n, _ in model.named_modules() if n]
    hits = []
    for text in patterns:
        rx = module_pattern(text)
        found = [n for n in names if rx.match(n)]
        if not found:
            examples = ", ".join(n for n in names if re.search(r"\.0\.[^.]+$", n))[:160]
            raise UserError(f"activation_checkpointing.modules: '{text}' matches no module of "
                            f"{type(model).__name__} ('*' is one path part; e.g. {examples})")
        hits += [n for n in found if n not in hits]
    return hits


def remove_plan(model: nn.Module) -> None:
    """Undo `apply_plan` (no layer or module recomputed)."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415 transformers: heavy, imported only when this runs

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


def apply_plan(model: nn.Module, plan: ACPlan, compiled: Optional[CompiledLayers] = None) -> list[str]:
    """Install `plan` on a causal LM (or directly on its decoder-layer list), replacing any
    earlier plan; with `compiled` (train.compile), every decoder layer runs compiled in training.
    Returns (and emits as RuntimeWarning) warnings about stateful modules."""
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
            units.append(sublayer(layer, mode))
        if mode != KEEP:
            _checkpoint_module(units[-1], checkpoint_function(plan, i, offloader, compiled=compiled))
        if compiled is not None and mode in (KEEP, ATTN, MLP):  # compiled as it is (a sublayer's checkpoint inside)
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = compiled.forward
    for start, stop in plan.segments:
        segment = _Segment(list(layers[start:stop]), checkpoint_function(plan, start, offloader),
                           compiled_fn(compiled))
        for layer in layers[start:stop]:
            layer._gradient_checkpointing_func = segment.call
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


def checkpoint_calls(model: nn.Module, plan: ACPlan) -> int:
    """Checkpoint calls one forward makes under an installed plan: one per recomputed layer or
    sqrt segment (the plan's offload units), plus one per module matched by policy 'modules'
    (those carry `_ac_checkpoint`, as do attn/mlp sublayers, which the units already count)."""
    sublayers = sum(mode in (ATTN, MLP) for mode in plan.layers)
    marked = sum(getattr(m, "_ac_checkpoint", None) is not None for m in model.modules())
    return len(plan.offload_units) + marked - sublayers

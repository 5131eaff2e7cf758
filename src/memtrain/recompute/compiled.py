"""Compiled decoder layers: `train.compile` runs each layer's forward under torch.compile, recompute traced inside.

torchtitan's order: recompute inside the compiled region. A layer's checkpoint is traced by dynamo as one
`tag_activation_checkpoint` region, and AOTAutograd's partitioner recomputes what the policy does not save inside
the compiled backward (fused with it). Mode `op` takes its save decisions once, while the layer is traced
(`selective_trace_context_fn`). Layers that recompute nothing are compiled too.

The compiled unit is the layer's `forward`, called through transformers' per-layer checkpoint hook
(`GradientCheckpointingLayer._gradient_checkpointing_func`); the layer's `__call__`, and with it ZeRO-3's
gather and release hooks (`torch.compiler.disable`), stays outside. With the decoder layers as ZeRO-3 leaf
modules (memtrain.config.zero3) no hook sits inside a layer, and its body compiles whole: one graph that every
layer of one kind shares (dynamo treats the layer as an input: a Llama's 22 layers compile once, Gemma-3's sliding
and full-attention layers twice).

What is traced stays apart from what runs eagerly around it: memtrain's activation offload packs the compiled
function's saved inputs with saved-tensor hooks around the call; DeepSpeed's reentrant checkpoint runs the
compiled forward inside its own (eager) checkpoint; sqrt segments call each layer's compiled forward inside
the segment's eager checkpoint.

Shapes are static (`dynamic=False`): a run's batches have one shape, and a change would rather recompile, with
a warning that names it (`CompileWatch`), than switch to slower dynamic kernels.

The activation profile (memtrain.memory.profile) compiles the same callables with `partitioned_eager`: the layer split
into forward and backward as inductor splits it, without code generation, so that fake tensors show what a compiled
layer saves.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import types
from typing import Callable, Optional, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.recompute.policy import draws_random, op_rules


def _forward(function, *args):
    return function(*args)


def _recompute(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


def _selective_contexts(entries: tuple[str, ...]):
    """The selective-checkpoint contexts of one traced region: the rules of eager mode op
    (memtrain.recompute.hooks.op_context_fn), decided once, in forward order, while the layer is traced. 'but-last'
    needs nothing here: AOTAutograd's partitioner saves only what the compiled backward reads, and an output that
    only feeds additions is not read."""
    rules = op_rules(entries)
    # the trace asks in the forward and again in the recompute, whose count must start where the forward's did
    counts = {False: [0] * len(rules), True: [0] * len(rules)}

    def policy(ctx, func, *args, **kwargs):
        if draws_random(func, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        for i, (ops, every, _) in enumerate(rules):
            if func in ops:
                counted = counts[bool(getattr(ctx, "is_recompute", False))]
                counted[i] += 1
                return CheckpointPolicy.MUST_SAVE if (counted[i] - 1) % every == 0 \
                    else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def selective_trace_context_fn(entries) -> Callable:
    """`context_fn` for a selective checkpoint that torch.compile traces, with the save list `entries`. A partial of
    a module-level function: dynamo takes it as a constant, and inductor's cache can pickle it."""
    context_fn = functools.partial(_selective_contexts, tuple(entries))
    # AOTAutograd's on-disk cache keys the region by it: the save list, and this code (an edit must not reuse
    # graphs compiled with other decisions)
    code = "".join(inspect.getsource(f) for f in (_selective_contexts, op_rules, draws_random))
    context_fn.cache_hash = hashlib.sha256(f"{code}{tuple(entries)!r}".encode()).hexdigest()
    return context_fn


class CompiledLayers:
    """The compiled callables a model's decoder layers share, each `fn(function, *args)` with `function` the
    layer's forward bound to its keyword arguments (what transformers' checkpoint hook passes):

    * `forward`: the layer as it is (layers that keep their activations; inside an eager checkpoint);
    * `full`: the layer recomputed whole in the compiled backward;
    * `op`: the layer under selective checkpoint with the plan's op save list;
    * `inner`: not compiled itself: the checkpoint a recomputed sublayer runs inside its compiled layer.
    """

    def __init__(self, op_save: tuple[str, ...], backend: Union[str, Callable] = "inductor") -> None:
        _quiet_trace_warnings()
        # dynamo gives up compiling a code object after `recompile_limit` variants (8) and runs it eager from then
        # on. All layers share these functions: layer kinds x grad modes (DeepSpeed's checkpoint runs the forward
        # without grad too) x the modes of a plan can pass 8 in a real run. One run per process: raised for it.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        context_fn = selective_trace_context_fn(op_save)

        def selective(function, *args):
            return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn)

        # another backend (the profile's `partitioned_eager`) compiles code objects of its own: dynamo's cache of the
        # run's inductor graphs is neither reused nor filled by it
        own = (lambda fn: fn) if backend == "inductor" else _own_code
        self.forward = torch.compile(own(_forward), backend=backend, dynamic=False)
        self.full = torch.compile(own(_recompute), backend=backend, dynamic=False)
        self.op = torch.compile(_own_code(selective), backend=backend, dynamic=False)
        self.inner = _recompute


def partitioned_eager(gm: torch.fx.GraphModule, example_inputs):
    """A torch.compile backend that splits a layer into forward and backward as inductor does, and runs both eagerly:
    inductor's decompositions, its joint-graph passes and its min-cut partitioner (`compile_fx.partition_fn`), no
    code generation. The forward graph's outputs beyond the layer's are what a compiled layer saves for its backward
    (memtrain.memory.profile measures them on fake tensors)."""
    from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415 torch._dynamo, inductor: seconds to import; only a compiled profile uses them
    from torch._dynamo.backends.debugging import get_nop_func  # noqa: PLC0415 as above
    from torch._inductor import compile_fx  # noqa: PLC0415 as above
    from torch._inductor.virtualized import V  # noqa: PLC0415 as above

    # inductor's own partition step (joint-graph passes, then the min-cut partitioner); where a torch has none by that
    # name, the partitioner as inductor calls it (torch's aot_eager_decomp_partition)
    partition = getattr(compile_fx, "partition_fn", None) or functools.partial(
        _min_cut_partition(), compiler="inductor")
    # inductor runs its partition step under the inputs' fake mode (compile_fx sets V's): its joint-graph passes read it
    # (a layer that draws random numbers, dropout, has its seeds fused there)
    fake_mode = torch._guards.detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode(
        allow_non_fake_inputs=True)
    with V.set_fake_mode(fake_mode):
        return aot_autograd(fw_compiler=get_nop_func(), bw_compiler=get_nop_func(),
                            decompositions=compile_fx.select_decomp_table(), partition_fn=partition)(gm, example_inputs)


def _min_cut_partition() -> Callable:
    """functorch's min-cut partitioner (imported only where a torch lacks inductor's own partition step)."""
    from functorch.compile import min_cut_rematerialization_partition  # noqa: PLC0415 functorch: seconds to import; an older torch's fallback only

    return min_cut_rematerialization_partition


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own. dynamo keeps compiled code per code object and does not guard which
    context_fn a checkpoint's closure holds: two save lists in one process would share the first one's graph."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


RECOMPILE_LIMIT = 64


class _NoContextFnNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


def _quiet_trace_warnings() -> None:
    """torch warns once per process that a checkpoint with a context_fn (mode op) is traced, about in-place ops in
    the region; a clean run prints its plan, a bar and a summary. Only that notice is dropped: selective checkpoint
    under compile keeps an in-place op's result as the graph computes it, which is what eager op recomputes."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _NoContextFnNotice) for f in logger.filters):
        logger.addFilter(_NoContextFnNotice())


# --------------------------------------------------------------------------- compiles, counted

def _metrics() -> list:
    from torch._dynamo.utils import get_compilation_metrics  # noqa: PLC0415 torch._dynamo: seconds to import; only a compiled run counts its compiles

    return get_compilation_metrics()


_KINDS = {"_forward": "a decoder layer", "_recompute": "a recomputed decoder layer",
          "selective": "an op-level recomputed decoder layer"}


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters  # noqa: PLC0415 torch._dynamo: seconds to import; only a compiled run counts its compiles

    return sum(counters["graph_break"].values())


class CompileWatch:
    """dynamo's compiles in this process, read at a step's end on the host (no device sync): how many, the graph
    breaks, and why each compile after the warm-up happened (dynamo's recompile reason, e.g. a size guard). A
    compiled region's backward (compiled at its first backward) and a GPU kernel's autotuning at its first run count
    with their forward, not on their own."""

    def __init__(self) -> None:
        self._seen = list(_metrics())  # held, not their ids: dynamo keeps the last 64, and an id may come back
        self._breaks = _graph_breaks()
        self._seconds = compile_seconds()  # a compiled profile's (memtrain.memory.profile) are not the run's
        self.compiles = 0
        self.graph_breaks = 0
        self.late: list[str] = []  # one line per compile after the warm-up, with its reason

    def seconds(self) -> float:
        """Seconds spent compiling since the watch began (`compile_seconds`)."""
        return compile_seconds() - self._seconds

    def step_done(self, step: int, warmed_up: bool) -> list[str]:
        """Compiles since the last call; after the warm-up, a warning line for each (returned)."""
        seen = {id(m) for m in self._seen}
        fresh = [m for m in _metrics() if id(m) not in seen]
        self._seen = (self._seen + fresh)[-256:]
        frames = [m for m in fresh if getattr(m, "is_forward", None) is not False and not getattr(m, "is_runtime", False)]
        self.compiles += len(frames)
        self.graph_breaks = _graph_breaks() - self._breaks
        lines = []
        for m in frames if warmed_up else ():
            reason = (getattr(m, "recompile_reason", None) or "a new code path").strip().splitlines()[0]
            kind = _KINDS.get(getattr(m, "co_name", None) or "", "a function")
            lines.append(f"torch.compile compiled {kind} again at step {step + 1}, after the warm-up ({reason}); each "
                         "recompile costs seconds, and the shapes of a run should not change")
        self.late += lines
        return lines


def compile_seconds() -> float:
    """Seconds this process spent compiling, forward and backward (dynamo's own timers; a GPU kernel's autotuning at
    its first run is not in them)."""
    from torch._dynamo.utils import compilation_time_metrics  # noqa: PLC0415 torch._dynamo: seconds to import; only a compiled run counts its compiles

    return sum(sum(compilation_time_metrics.get(name, ())) for name in ("_compile.compile_inner",
                                                                         "backward._backward_impl"))


def compile_line(watch: CompileWatch, measured: Optional[int] = None, planned: Optional[int] = None) -> str:
    """The compile line once the warm-up is over; with the activation bytes one forward saved (`measured`, the
    run's ActivationMeter) and what the plan predicted for the compiled layers (`planned`), how far apart they are."""
    late = len(watch.late)
    line = (f"compile: {watch.compiles} compile{'s' if watch.compiles != 1 else ''}, {watch.seconds():.1f} s "
            f"(forward and backward); {late} recompile{'s' if late != 1 else ''} after the warm-up")
    if watch.graph_breaks:
        line += (f"; {watch.graph_breaks} graph break{'s' if watch.graph_breaks != 1 else ''} (parts of a layer run "
                 "eager: TORCH_LOGS=graph_breaks names them)")
    if measured is not None and planned:
        line += (f"; activations one forward saved, measured: {measured / 2**20:.2f} MiB, against the plan's "
                 f"{planned / 2**20:.2f} MiB ({(measured - planned) / planned:+.0%})")
    return line


def compiled_fn(compiled: Optional[CompiledLayers]) -> Callable:
    """How a layer's forward runs inside an eager unit (a sqrt segment, DeepSpeed's checkpoint)."""
    return compiled.forward if compiled is not None else _forward

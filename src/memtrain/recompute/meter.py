"""Activation bytes, measured: saved for the backward (saved-tensor hooks), and live per op (a dispatch mode).

The estimate, the ac-profile and the trainer's `memory/activation_gib` all count with these two, on
real and on fake tensors alike. torch.distributed._tools.MemTracker attributes memory to modules and
categories; memtrain needs the saved set alone (what recompute changes) and an op-by-op curve with
named marks (what the per-layer estimate is built from), which it does not give.
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Iterable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

_ACTIVE_METER: Optional["ActivationMeter"] = None


def current_activation_meter() -> Optional["ActivationMeter"]:
    return _ACTIVE_METER


def _is_parameter(t: torch.Tensor) -> bool:
    """Parameters and views of them (linear saves `weight.t()`) are weights, not activations."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationMeter:
    """Bytes saved for backward and still alive at the end of the forward.

    Every tensor autograd saves goes through `saved_tensors_hooks`; parameters (and views of
    them) are not activations and are skipped. Storages are counted once (views share them), and sizes
    are read at the end of the forward, so checkpoints that were offloaded or freed in the
    meantime count as what they really hold. Torch's non-reentrant checkpoint keeps its
    inputs through a closure rather than autograd, so it reports them with `retain`.

    `offloaded_bytes` counts what memtrain's offload (`memtrain.recompute.offload`) moved to host memory
    during the forward; those tensors no longer count in `bytes`. On CPU both are host memory.
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self.bytes = 0
        self.offloaded_bytes = 0
        self._offloaded = 0

    def offloaded(self, nbytes: int) -> None:
        self._offloaded += nbytes

    def retain(self, tensors: Iterable) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and not _is_parameter(t):
                self._refs.append(weakref.ref(t))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            self._refs.append(weakref.ref(t))
        return t

    @contextmanager
    def measure(self, keep: bool = False):
        """Count what the block saves; `keep`: hold the weak references for `storages()` until `release()`."""
        global _ACTIVE_METER
        self._refs.clear()
        self._offloaded = 0
        previous, _ACTIVE_METER = _ACTIVE_METER, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE_METER = previous
            self.bytes = self._alive_bytes()
            self.offloaded_bytes = self._offloaded
            if not keep:
                self.release()

    def release(self) -> None:
        self._refs.clear()

    def storages(self) -> list:
        """The distinct storages still alive among what was saved (and retained)."""
        out = {}
        for ref in self._refs:
            t = ref()
            if t is None:
                continue
            s = t.untyped_storage()
            if s.nbytes():  # keyed by the storage object itself: views share it; fake tensors have no address
                out[s._cdata] = s
        return list(out.values())

    def _alive_bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages())


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (flat, or one level of lists/tuples/dicts)."""
    out = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
        elif isinstance(x, dict):
            out.extend(y for y in x.values() if isinstance(y, torch.Tensor))
    return out


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it: what the host dispatches in a step (gpu-check's probe,
    memtrain.train.zero3_probe). `prim` metadata calls, which fake tensors make and real ones do not, are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


_DEVICE = torch.ops.prim.device.default


class StepTracker(TorchDispatchMode):
    """Follows a step op by op: every storage an op creates and the moment it dies, and with `count_flops` their
    FLOPs.

    Liveness is read from weak references to the C++ storages themselves, swept after every op,
    so a storage counts as freed exactly when its memory would go back to the allocator (Python
    garbage collection plays no part). Works alike on real and on fake tensors.

    FLOPs are torch's FlopCounterMode formulas (`torch.utils.flop_counter.flop_registry`, with memtrain.memory.flops's
    registered), applied here rather than by a FlopCounterMode under this mode: one dispatch mode instead of two makes
    a fake-tensor measurement about a quarter quicker. FlopCounterMode also splits an op without a formula into its
    decomposition where it has one (silu_backward); no op it splits has a formula, so the totals are the same.
    """

    def __init__(self, block: int = 1, count_flops: bool = False) -> None:
        super().__init__()
        self.block = block
        self.formulas = flop_registry if count_flops else {}
        self.flops = 0  # FLOPs of the step so far (0 without count_flops)
        self.events: list[tuple[int, int]] = []  # (+bytes at allocation | -bytes at free, storage serial)
        self.marks: dict[str, tuple[int, float, int]] = {}  # name -> (event index, FLOPs, bytes written)
        self._live: dict[int, tuple[int, int, int]] = {}  # storage key -> (weak C++ ref, bytes, serial)
        self._refs: dict[int, int] = {}  # storage key -> weak C++ ref: the same storages, for the sweep's quick pass
        self.written = 0  # bytes written into fresh storage: the memory-traffic proxy of the step

    def mark(self, name: str) -> None:
        self.sweep()
        self.marks[name] = (len(self.events), self.flops, self.written)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:  # a fake tensor's device, asked about as often as every other op together: no storage
            return func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in _tensors((*args, *kwargs.values()))}
        out = func(*args, **kwargs)
        formula = self.formulas.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        self.sweep()
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            storage = t.untyped_storage()
            if storage._cdata not in inputs:  # views and in-place results allocate nothing
                self._track(storage)
        return out

    def sweep(self) -> None:
        expired = torch.UntypedStorage._expired  # what StorageWeakRef.expired calls, without the wrapper
        if not any(map(expired, self._refs.values())):  # most ops free nothing: one pass without a Python loop
            return
        dead = [key for key, ref in self._refs.items() if expired(ref)]
        for key in dead:
            del self._refs[key]
            _, nbytes, serial = self._live.pop(key)
            self.events.append((-nbytes, serial))

    def adopt(self, storage) -> None:
        """Count a storage made before the tracker was entered (e.g. the activations a forward saved)."""
        self._track(storage)

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        nbytes = math.ceil(storage.nbytes() / self.block) * self.block
        serial = len(self.events)
        self._live[key] = (storage._weak_ref(), nbytes, serial)
        self._refs[key] = self._live[key][0]
        self.written += nbytes
        self.events.append((nbytes, serial))

    def curve(self) -> list[int]:
        """Live bytes after each event."""
        live, out = 0, [0]
        for delta, _ in self.events:
            live += delta
            out.append(live)
        return out


class CompiledCodeTracker(StepTracker):
    """StepTracker for compiled layers (train.compile's profile): torch.compile compiles under it (dynamo compiles
    nothing under another dispatch mode), and it follows the compiled code's ops as they run, not the compiler's.
    A compiled region's higher-order ops (the recompute's saved RNG state) pass through it: their results are
    tracked, the ops inside them are not seen one by one."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

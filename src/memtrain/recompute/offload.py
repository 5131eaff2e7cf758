"""Offload of checkpointed activations to host memory: memtrain's `cpu_checkpointing`.

A recomputed layer keeps one thing for its backward: its checkpointed input. With offload on,
that input goes to a pinned host buffer during the forward and comes back during the backward:

* forward: the device-to-host copy is enqueued on a side stream as soon as the checkpoint holds
  the input (torch: as the call starts; DeepSpeed: right after it), so it overlaps the layers'
  compute; the device memory goes back to the caching allocator when its last user drops it
  (`record_stream` keeps it from being reused before the copy has read it);
* backward: when the backward reaches a recomputed layer, the inputs of the next
  `prefetch_depth` offloaded layers it will recompute are copied back on the side stream, so
  each copy overlaps a whole layer's recompute and backward; the compute stream waits on an
  event only when it needs the tensor;
* host buffers come from a pool and go back to it as soon as their host-to-device copy is
  enqueued: after the first step no pinned memory is allocated, and host memory does not grow;
  when a forward starts, the pool drops what the step before did not use (see HostBufferPool),
  so shapes that shrink give host memory back.

One side stream carries both directions, so a buffer's host-to-device copy is ordered before any
later device-to-host copy into the same buffer: no event is needed to recycle a buffer.

The copy operations sit behind a small interface (`CudaCopies`, `HostCopies`), so the scheduling
(slots, prefetch, pool) is the same code on CPU, where the copies are plain synchronous copies.

Hooking in: `wrap()` turns a checkpoint function into one that offloads its inputs.
* torch's non-reentrant checkpoint saves its inputs as autograd saved tensors, so
  `saved_tensors_hooks` around the call pack them to host and unpack them back;
* DeepSpeed's reentrant checkpoint keeps the very tensor objects it is given on its `ctx`, so it
  gets aliases of them whose storage is swapped out after the call and back in just before its
  backward (the caller's tensors are never touched). DeepSpeed's own CPU_CHECKPOINT must be off.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.recompute.meter import current_activation_meter

PREFETCH_DEPTH = 2  # offloaded layers copied back ahead of the recompute that needs them


def offload_units(recomputed, segments=()) -> tuple[int, ...]:
    """The layers whose call is one checkpoint, i.e. one saved input: an offload unit. Every
    recomputed layer is one, except inside a segment, which is one unit named by its first layer
    (the segment runs as one checkpoint, which keeps the segment's input: the first layer's)."""
    inside = {i for start, stop in segments for i in range(start + 1, stop)}
    return tuple(i for i, r in enumerate(recomputed) if r and i not in inside)


def offload_flags(recomputed, cpu_checkpointing: bool, skip_last: int, every: bool = False,
                  segments=()) -> tuple[bool, ...]:
    """Per layer, whether the checkpoint call it makes sends its input to host: every offload unit
    (`offload_units`: a recomputed layer, or a segment's first layer) but the last `skip_last` units (the
    backward needs those first, before a copy back could overlap anything); with `every`, all of
    them (DeepSpeed's own CPU_CHECKPOINT has no per-call choice)."""
    order = offload_units(recomputed, segments)
    chosen = set(order if every else order[: max(len(order) - skip_last, 0)])
    return tuple(cpu_checkpointing and i in chosen for i in range(len(recomputed)))


# --------------------------------------------------------------------------- copy engines

class CudaCopies:
    """Asynchronous copies on one side stream, ordered against the compute stream with events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def trim_host_memory() -> None:
        """Give the pinned blocks the pool dropped back to the OS: torch's pinned-memory allocator
        caches freed blocks (it frees only those whose copies have completed)."""
        torch._C._host_emptyCache()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # src is still being written
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # its owner drops it now; the allocator waits for this copy

    def to_device(self, src: torch.Tensor):
        with torch.cuda.stream(self.stream):  # allocated on the side stream: no wait on compute
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return dst, ready

    def wait(self, tensor: torch.Tensor, ready) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        tensor.record_stream(current)  # used on the compute stream from now on


class HostCopies:
    """CPU: the 'device' is host memory, so copies are plain and synchronous."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def to_device(self, src: torch.Tensor):
        return src.clone(), None

    def wait(self, tensor: torch.Tensor, ready) -> None:
        pass


# --------------------------------------------------------------------------- host buffer pool

class HostBufferPool:
    """Reusable host byte buffers (pinned on CUDA), bounded by what one step uses.

    * A buffer is reused for any request it fits without wasting more than half of it, so
      steady-state steps allocate nothing.
    * At each step boundary (`end_step`, called by the offloader when a new forward starts), the
      pool drops the free buffers no request used during the step that just ended, and caps the
      bytes it keeps cached at that step's high-water mark of bytes in use: a run whose shapes
      shrink gives the excess back (on CUDA through `trim`, which empties torch's pinned-memory
      cache as well). A buffer kept for a smaller request wastes at most half of itself, so what
      stays cached is at most twice what the step needed, and exactly that when every buffer fits.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], trim: Optional[Callable[[], None]] = None):
        self._allocate = allocate
        self._trim = trim
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # buffers come back from autograd's thread too
        self._used: set[int] = set()  # ids of the buffers handed out during this step
        self._out: set[int] = set()  # ids of the buffers handed out now
        self.allocations = 0      # buffers allocated, all time
        self.frees = 0            # buffers dropped by `end_step`, all time
        self.capacity_bytes = 0   # bytes of every buffer the pool owns now (in use + cached)
        self.cached_bytes = 0     # bytes of the free buffers
        self.in_use_bytes = 0     # bytes of the buffers handed out now
        self.step_peak_bytes = 0  # high-water mark of in_use_bytes during this step
        self.last_step_peak_bytes = 0  # the same for the last completed step

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self.cached_bytes -= buf.numel()
            else:
                buf = None
                self.allocations += 1
                self.capacity_bytes += nbytes
        if buf is None:
            buf = self._allocate(nbytes)
        with self._lock:
            self._used.add(id(buf))
            self._out.add(id(buf))
            self.in_use_bytes += buf.numel()
            self.step_peak_bytes = max(self.step_peak_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._out.discard(id(buf))
            self.cached_bytes += buf.numel()
            self.in_use_bytes -= buf.numel()

    def cached_buffers(self) -> tuple[torch.Tensor, ...]:
        """The free buffers now (for inspection)."""
        with self._lock:
            return tuple(self._free)

    def end_step(self) -> int:
        """A step is complete: drop the free buffers it did not use, then the largest free ones
        until the cached bytes are within its high-water mark of bytes in use. Returns the bytes
        dropped."""
        with self._lock:
            keep = [b for b in self._free if id(b) in self._used]
            drop = [b for b in self._free if id(b) not in self._used]
            keep.sort(key=lambda b: b.numel())
            cached = sum(b.numel() for b in keep)
            while keep and cached > self.step_peak_bytes:
                cached -= keep[-1].numel()
                drop.append(keep.pop())
            self._free = keep
            dropped = sum(b.numel() for b in drop)
            self.cached_bytes = cached
            self.capacity_bytes -= dropped
            self.frees += len(drop)
            self.last_step_peak_bytes = self.step_peak_bytes
            self.step_peak_bytes = self.in_use_bytes  # buffers still out count for the next step
            self._used = set(self._out)
        del keep, drop  # the pool held the last references: the memory goes now
        if dropped and self._trim is not None:
            self._trim()
        return dropped


# --------------------------------------------------------------------------- offloaded tensors

class _Offloaded:
    """One checkpointed tensor while it lives in host memory (what autograd holds instead)."""

    __slots__ = ("_owner", "_buf", "_shape", "_dtype", "_nbytes", "_restored", "_ready", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", tensor: torch.Tensor):
        self._owner = owner
        self._shape, self._dtype = tensor.shape, tensor.dtype
        self._nbytes = tensor.numel() * tensor.element_size()
        self._buf = owner.pool.acquire(self._nbytes)
        self._restored = self._ready = None
        owner.copies.to_host(tensor, self._host_view())
        owner._count(self._nbytes)
        meter = current_activation_meter()
        if meter is not None:
            meter.offloaded(self._nbytes)

    def _host_view(self) -> torch.Tensor:
        return self._buf[: self._nbytes].view(self._dtype).view(self._shape)

    @property
    def prefetched(self) -> bool:
        return self._buf is None

    def prefetch(self) -> None:
        """Enqueue the copy back to the device; the host buffer returns to the pool at once."""
        if self._buf is None:
            return
        self._restored, self._ready = self._owner.copies.to_device(self._host_view())
        self._give_back()

    def fetch(self) -> torch.Tensor:
        """The tensor on the device, safe to use on the current stream."""
        self.prefetch()
        tensor, self._restored = self._restored, None
        if tensor is None:
            raise RuntimeError("memtrain offload: a checkpointed input was asked for twice; offloaded "
                               "checkpoints support one backward per forward (no retain_graph)")
        self._owner.copies.wait(tensor, self._ready)
        return tensor

    def _give_back(self) -> None:
        self._owner.pool.release(self._buf)
        self._owner._count(-self._nbytes)
        self._buf = None

    def __del__(self):  # the graph was dropped without a backward: recycle the buffer
        if self._buf is not None:
            self._give_back()


class _Slot:
    """One checkpointed call of the forward, in call order; the backward meets them in reverse."""

    __slots__ = ("index", "offload", "entries", "reached", "inputs", "__weakref__")

    def __init__(self, index: int, offload: bool):
        self.index, self.offload = index, offload
        self.entries: list[_Offloaded] = []
        self.reached = False
        self.inputs: Optional[set[int]] = None  # storages whose tensors go to host (None: every saved tensor)


class StorageAlias(torch.autograd.Function):
    """A second tensor object on the same storage, with the gradient passed through. Not a view:
    a view would keep the original alive through `_base`, and no memory would be freed."""

    @staticmethod
    def forward(ctx, t):
        return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad


# --------------------------------------------------------------------------- the offloader

def _offloadable(t) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
            and t.is_floating_point() and t.numel() > 0)


def _grad_node(out):
    """The autograd node that produced a checkpointed call's output (None if it needs no grad)."""
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t.grad_fn
    return None


class ActivationOffloader:
    """Offloads the inputs of wrapped checkpoint calls to host memory and prefetches them back."""

    def __init__(self, prefetch_depth: int = PREFETCH_DEPTH, copies=None):
        if prefetch_depth < 1:
            raise ValueError("prefetch_depth must be at least 1")
        self.prefetch_depth = prefetch_depth
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._copies = copies
        self._pool: Optional[HostBufferPool] = None
        self._slots: list[weakref.ref] = []  # this forward's checkpointed calls, in call order
        self._lock = threading.Lock()
        self.offloaded = 0        # tensors sent to host, all time
        self.prefetch_misses = 0  # offloaded layers the backward reached before any prefetch
        self.live_bytes = 0       # host bytes held by offloaded tensors now

    @property
    def copies(self):
        if self._copies is None:  # bound on first use, to the device the activations live on
            self._copies = CudaCopies(torch.device("cuda", torch.cuda.current_device())) \
                if self.device_type == "cuda" else HostCopies()
        return self._copies

    @copies.setter
    def copies(self, engine) -> None:
        if self._pool is not None:
            raise RuntimeError("memtrain offload: the copy engine is already in use")
        self._copies = engine

    @property
    def pool(self) -> HostBufferPool:
        if self._pool is None:
            self._pool = HostBufferPool(self.copies.host_buffer, getattr(self.copies, "trim_host_memory", None))
        return self._pool

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes += nbytes

    # ---- the hook point
    def wrap(self, checkpoint_fn: Callable, backend: str, offload: bool, inputs_only: bool = False) -> Callable:
        """A checkpoint function with the same signature whose call's inputs are offloaded (when
        `offload`) and whose backward schedules the prefetches of the layers before it.
        `inputs_only`: the call saves more than its inputs with autograd (a compiled layer saves what its
        compiled backward reads): only tensors on the inputs' storages go to host, as in an eager checkpoint."""
        run = self._checkpoint_torch if backend == "torch" else self._checkpoint_deepspeed

        def checkpoint(function, *args, **kwargs):
            if not torch.is_grad_enabled():  # nothing is saved, nothing to offload
                return checkpoint_fn(function, *args, **kwargs)
            slot = self._new_slot(offload)
            if inputs_only:
                slot.inputs = {t.untyped_storage().data_ptr() for t in args if self._is_device_tensor(t)}
            return run(checkpoint_fn, slot, function, *args, **kwargs)

        return checkpoint

    def _checkpoint_torch(self, checkpoint_fn, slot, function, *args, **kwargs):
        if slot.offload:
            # Only the checkpoint's own inputs reach these hooks: inside the call, torch's
            # checkpoint installs its own hooks for everything the layer saves.
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(slot, t), self._unpack):
                out = checkpoint_fn(function, *args, **kwargs)
        else:
            out = checkpoint_fn(function, *args, **kwargs)
        self._on_backward(out, slot, restore=())
        return out

    def _checkpoint_deepspeed(self, checkpoint_fn, slot, function, *args, **kwargs):
        if not slot.offload:
            out = checkpoint_fn(function, *args, **kwargs)
            self._on_backward(out, slot, restore=())
            return out
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        if ds_checkpointing.CPU_CHECKPOINT:
            raise RuntimeError("memtrain offload: DeepSpeed's own CPU_CHECKPOINT is on as well; configure "
                               "DeepSpeed with memtrain.recompute.hooks.configure_deepspeed_ac(spec, number_checkpoints)")
        args = tuple(StorageAlias.apply(a) if self._is_device_tensor(a) else a for a in args)
        out = checkpoint_fn(function, *args, **kwargs)
        restore = []
        for a in args:
            if self._is_device_tensor(a):
                entry = self._offload(slot, a)
                a.data = torch.empty(0, dtype=a.dtype, device=a.device)  # what DeepSpeed holds now
                restore.append((a, entry))
        self._on_backward(out, slot, restore)
        return out

    # ---- forward side
    def _new_slot(self, offload: bool) -> _Slot:
        with self._lock:
            new_step = not any((s := ref()) is not None and not s.reached for ref in self._slots)
            if new_step:
                self._slots = []  # the previous forward's backward is done (or its graph is gone)
            slot = _Slot(len(self._slots), offload)
            self._slots.append(weakref.ref(slot))
        if new_step and slot.index == 0 and self._pool is not None:
            self._pool.end_step()  # the step before this forward is complete: trim the pool to it
        return slot

    def _is_device_tensor(self, t) -> bool:
        return _offloadable(t) and t.device.type == self.device_type

    def _offload(self, slot: _Slot, t: torch.Tensor) -> _Offloaded:
        entry = _Offloaded(self, t)
        slot.entries.append(entry)
        self.offloaded += 1
        return entry

    def _pack(self, slot: _Slot, t: torch.Tensor):
        if not self._is_device_tensor(t) or slot.inputs is not None and t.untyped_storage().data_ptr() not in slot.inputs:
            return t
        return self._offload(slot, t)

    @staticmethod
    def _unpack(packed):
        return packed.fetch() if isinstance(packed, _Offloaded) else packed

    # ---- backward side
    def _on_backward(self, out, slot: _Slot, restore) -> None:
        """When the backward reaches this call's output: prefetch ahead, restore DeepSpeed's inputs.

        The hook holds the slot (and so its host buffers) for as long as autograd holds the graph. It lets go of
        DeepSpeed's inputs once restored: DeepSpeed drops its own reference after the layer's backward, and the
        restored input goes then. Held here, each would stay on the device for as long as the graph: the trainer
        keeps the loss through the optimizer step and the next forward (measured on one H100: the offloaded
        inputs' 1.31 GiB above policy full's peak; see reports/readme/gpu-h100-prediction.md)."""
        node = _grad_node(out)
        if node is None:
            return

        def reached(grad_outputs):
            self._reached(slot)
            while restore:
                alias, entry = restore.pop()
                alias.data = entry.fetch()

        node.register_prehook(reached)

    def _reached(self, slot: _Slot) -> None:
        with self._lock:
            slot.reached = True
            if slot.offload and not all(e.prefetched for e in slot.entries):
                self.prefetch_misses += 1
            ahead = []
            in_order = slot.index < len(self._slots) and self._slots[slot.index]() is slot
            for ref in reversed(self._slots[: slot.index] if in_order else []):
                s = ref()  # the backward recomputes them last-first
                if s is not None and s.offload and not s.reached:
                    ahead.append(s)
                    if len(ahead) == self.prefetch_depth:
                        break
        for s in ([slot] if slot.offload else []) + ahead:
            for entry in s.entries:
                entry.prefetch()

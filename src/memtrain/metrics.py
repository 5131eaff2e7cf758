"""Measurements: activation bytes (saved-tensor hooks), device/host memory, step medians."""
from __future__ import annotations

import statistics
import weakref
from contextlib import contextmanager
from typing import Iterable, Optional

import torch
from torch import nn

GIB = float(1 << 30)

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

    `offloaded_bytes` counts what memtrain's offload (`memtrain.offload`) moved to host memory
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
    def measure(self):
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
            self._refs.clear()

    def _alive_bytes(self) -> int:
        storages: dict[tuple, int] = {}
        for ref in self._refs:
            t = ref()
            if t is None:
                continue
            s = t.untyped_storage()
            if s.nbytes():
                storages[(t.device, s.data_ptr())] = s.nbytes()
        return sum(storages.values())


def device_memory() -> tuple[float, float]:
    """Peak (allocated, reserved) accelerator GiB since the last reset; 0 on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
    return 0.0, 0.0


def reset_device_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def host_rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / GIB


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def medians(history: list[dict[str, float]], skip: int) -> dict[str, float]:
    """Median of every metric over the steps after the first `skip` (all steps if too few)."""
    rows = history[skip:] or history
    tags = sorted({k for row in rows for k in row})
    return {tag: statistics.median(row[tag] for row in rows if tag in row) for tag in tags}


class IntervalTimer:
    """Seconds of device time between `start()` and `stop()`: CUDA events on a GPU (no host sync
    until `stop`, which waits for the interval's last kernel), the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._begin.record()
        else:
            import time

            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3
        import time

        return time.perf_counter() - self._t0

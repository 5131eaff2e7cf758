"""Step measurements: device/host memory, step-time medians, CUDA-event interval timer."""
from __future__ import annotations

import statistics
import time

import torch
import psutil

from memtrain.units import GIB


def device_memory() -> tuple[float, float]:
    """Peak (allocated, reserved) accelerator GiB since the last reset; 0 on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
    return 0.0, 0.0


def reset_device_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def host_rss_gib() -> float:
    return psutil.Process().memory_info().rss / GIB


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
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3

        return time.perf_counter() - self._t0

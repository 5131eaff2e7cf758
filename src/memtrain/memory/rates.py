"""This machine's rates for the planner's time model: matmul FLOP/s, memory bandwidth, host copies."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Rates:
    """Measured speeds of this machine's device, for the planner's step-time model."""

    flops_per_s: float  # dense matmul in the compute dtype
    bytes_per_s: float  # device memory copy (bytes written per second)
    host_bytes_per_s: float  # device <-> host copy; 0 where there is no separate device memory
    device: str
    host_op_s: float = 0.0  # host seconds per aten op a recompute dispatches again (a hardware sheet's; not measured here)

    def to_dict(self) -> dict:
        return asdict(self)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int = 3) -> float:
    fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / reps


def measure_rates(dtype: str = "float32") -> Rates:
    """A few quick timings on this machine's device (a fraction of a second on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype) if device == "cuda" else torch.float32  # CPU matmuls run fastest in fp32
    n = 4096 if device == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dt)
    flops = 2 * n**3 / _timed(lambda: a @ a)
    buf = torch.empty(64 << 20 if device == "cuda" else 16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    copy_bw = buf.numel() / _timed(lambda: dst.copy_(buf))
    host_bw = 0.0
    if device == "cuda":
        host = torch.empty_like(buf, device="cpu").pin_memory()
        host_bw = buf.numel() / _timed(lambda: host.copy_(buf, non_blocking=True))
    return Rates(flops, copy_bw, host_bw, device)

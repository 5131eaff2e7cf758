"""Run faults (NaN/inf loss, out of memory): one clear line, and summary.json says the same.

The sweep runner reads summary.json's `status` ("failed" | "oom") and `reason`.
"""
from __future__ import annotations

import json
import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import psutil

from memtrain.train import checkpoint
from memtrain.train.run_dir import RunDir
from memtrain.units import GIB


@dataclass
class RunPosition:
    """Where the run is, for reporting a fault that escapes the training loop."""

    world: int = 1
    rank: int = 0
    run_dir: Optional[RunDir] = None
    step: int = 0  # completed steps
    bar: Any = None  # rank 0's progress bar, closed before a fault is reported


def last_checkpoint(run_dir: Optional[RunDir]) -> Optional[Path]:
    return checkpoint.latest_path(run_dir.checkpoints) if run_dir else None


def _last_good_and_hint(run_dir: RunDir, train) -> str:
    """Where the last good checkpoint is (saves are written from finite weights only), and what to try."""
    good = last_checkpoint(run_dir)
    kept = (f"last good checkpoint: {good} (kept; continue from it with --resume --run-dir {run_dir})" if good
            else f"no checkpoint was saved before it (train.save_interval={train.save_interval})")
    return (f"{kept}; hint: lower train.lr (now {train.lr:g}) or raise train.warmup_steps (now "
            f"{train.warmup_steps}), keep train.grad_clip > 0 (now {train.grad_clip:g}), and prefer bf16 to fp16")


def nonfinite_loss_message(loss: float, step: int, max_steps: int, run_dir: RunDir, train) -> str:
    """Loss went NaN/inf at `step` (1-based): say where the last good checkpoint is, and what to try."""
    return f"loss is {loss} at step {step} of {max_steps}; {_last_good_and_hint(run_dir, train)}"


def disk_full_message(step: int, run_dir: RunDir, needed: int, how: str, free: int) -> str:
    """A save that does not fit on the disk: where, how much, and the checkpoint that stays intact."""
    good = last_checkpoint(run_dir)
    kept = (f"latest is still {good.name} (intact; continue from it with --resume --run-dir {run_dir} once there "
            f"is room)" if good else "no earlier model checkpoint")
    return (f"disk full: the model checkpoint of step {step} needs about {needed / GIB:.2f} GiB ({how}) in "
            f"{run_dir.checkpoints}, which has {free / GIB:.2f} GiB free; nothing of it was kept; {kept}")


def nonfinite_weights_message(step: int, max_steps: int, run_dir: RunDir, train) -> str:
    """The weights after `step` hold NaN/inf (the update diverged before any loss showed it): nothing saved."""
    return (f"weights are not finite after step {step} of {max_steps} (NaN/inf in the parameters), so step {step} "
            f"was not saved; {_last_good_and_hint(run_dir, train)}")


# What torch prints when memory runs out: CUDA's OutOfMemoryError, and the CPU allocator's RuntimeError.
OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory", re.IGNORECASE)


def is_oom_text(text: str) -> bool:
    """A process's output (a sweep point's or bench set-up's stderr) says it ran out of memory."""
    return bool(OOM_TEXT.search(text))


def is_oom(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing (RuntimeError "can't allocate memory")."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and is_oom_text(str(e)))


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1


def host_memory_limit() -> tuple[int, str]:
    """The host memory this process may use and what sets it: the smallest of the machine's RAM, its cgroup's
    limit (a Slurm or container allocation) and its address-space limit (ulimit -v)."""
    limits = [(psutil.virtual_memory().total, "host RAM")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "RLIMIT_AS, ulimit -v"))
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < limits[0][0]:  # "max", or v1's near-2^63 "unlimited"
            limits.append((int(text), f"cgroup limit, {path}"))
        break
    return min(limits)


def _memory() -> tuple[str, int]:
    """('peak ... of ...', the bytes that bind) for the device that ran out: the GPU (its free memory plus what
    this process holds), or on CPU the host limit that binds this process (`host_memory_limit`)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        usable = min(free + torch.cuda.memory_reserved(), total)
        return (f"peak {peak / GIB:.2f} GiB allocated of {usable / GIB:.2f} GiB usable (free + this process's) on "
                f"{torch.cuda.get_device_name()}"), usable
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    limit, what = host_memory_limit()
    return f"peak host RSS {peak / GIB:.2f} GiB of {limit / GIB:.2f} GiB ({what})", limit


def _suggestion(recipe, ds_config: dict, world: int, budget_bytes: int) -> str:
    """The planner's prediction of what would fit; the usual levers if it has none."""
    try:
        from memtrain.memory.planner import suggest_fit  # noqa: PLC0415 the planner, only for an OOM report, inside its guard

        return f"planner: {suggest_fit(recipe, ds_config, world, budget_bytes)}"
    except Exception:  # a failing suggestion must not hide the OOM report
        pass
    t, ac = recipe.train, recipe.activation_checkpointing
    return (f"try activation_checkpointing.policy=full (now '{ac.policy}'), a smaller train.micro_batch_size "
            f"(now {t.micro_batch_size}) with more train.grad_accum_steps (now {t.grad_accum_steps}), "
            "or CPU offload (ds_configs/zero3_offload.json)")


def oom_message(progress: RunPosition, recipe, ds_config: dict) -> str:
    where = f"step {progress.step + 1}" if progress.run_dir else "start-up (building the model or engine)"
    memory, total = _memory()
    return (f"out of memory at {where} on rank {progress.rank}: {memory}; "
            f"{_suggestion(recipe, ds_config, progress.world, total)}")


def write_failure(progress: RunPosition, status: str, reason: str) -> None:
    """summary.json for a run that stopped on a fault (atomic: a reader never sees half of it)."""
    if progress.run_dir is None or not progress.run_dir.path.is_dir():
        return
    good = last_checkpoint(progress.run_dir)
    summary = {"status": status, "reason": reason, "steps": progress.step,
               "last_checkpoint": str(good) if good else None, "world_size": progress.world,
               "run_dir": str(progress.run_dir), "tensorboard": str(progress.run_dir.tensorboard)}
    checkpoint.atomic_write_text(progress.run_dir.summary_file, json.dumps(summary, indent=2))

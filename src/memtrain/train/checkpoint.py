"""Model checkpoints (save/resume) through DeepSpeed's engine, plus per-rank RNG state.

Not to be confused with activation checkpointing (see `memtrain.recompute`).

Saves are crash-safe: every rank writes into a hidden temporary directory, and only when all
ranks are done does rank 0 rename it to `stepNNNNNNNN` and then replace `latest` atomically.
A process killed mid-save leaves at most a `.tmp-*` directory, which the next save removes;
a `step*` directory therefore always holds a complete checkpoint, and resume uses the newest.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

TAG_PREFIX = "step"
TMP_PREFIX = ".tmp-"


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, ckpt_dir: Path, step: int, keep_last: int) -> str:
    """Save model, optimizer, scheduler and RNG state after `step` completed steps."""
    import deepspeed.comm as dist

    rank = dist.get_rank()
    tag, tmp_tag = tag_for(step), f"{TMP_PREFIX}{tag_for(step)}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(f"{TMP_PREFIX}*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state={"step": step}, save_latest=False)
    torch.save(_rng_state(), ckpt_dir / tmp_tag / f"rng_rank{rank}.pt")
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        final = ckpt_dir / tag
        if final.exists():  # the same step saved again (e.g. a resumed run preempted at once)
            old = ckpt_dir / f"{TMP_PREFIX}old-{tag}"
            os.replace(final, old)
            os.replace(ckpt_dir / tmp_tag, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(ckpt_dir / tmp_tag, final)
        atomic_write_text(ckpt_dir / "latest", tag)  # read by DeepSpeed's own tools (zero_to_fp32.py)
        _rotate(ckpt_dir, keep_last)
    dist.barrier()
    return tag


def _tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoints, oldest first (a `step*` directory only appears by rename)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.glob(f"{TAG_PREFIX}*") if p.is_dir())


def _rotate(ckpt_dir: Path, keep_last: int) -> None:
    for old in _tags(ckpt_dir)[:-keep_last]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def latest_tag(ckpt_dir: Optional[Path]) -> Optional[str]:
    """The newest complete checkpoint. Not `latest`: a kill between rename and its update is harmless."""
    tags = _tags(ckpt_dir) if ckpt_dir is not None else []
    return tags[-1] if tags else None


def latest_path(ckpt_dir: Optional[Path]) -> Optional[Path]:
    tag = latest_tag(ckpt_dir)
    return ckpt_dir / tag if tag else None


def load(engine, ckpt_dir: Path) -> int:
    """Restore the newest complete checkpoint into `engine`; returns the number of completed steps."""
    import deepspeed.comm as dist

    tag = latest_tag(ckpt_dir)
    _, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    rng_file = ckpt_dir / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(client_state["step"])


def has_checkpoint(ckpt_dir: Optional[Path]) -> bool:
    return latest_tag(ckpt_dir) is not None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)

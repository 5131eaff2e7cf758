"""Model checkpoints (save/resume) through DeepSpeed's engine, plus per-rank RNG state.

Not to be confused with activation checkpointing (see `memtrain.ac`).
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

    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step})
    torch.save(_rng_state(), ckpt_dir / tag / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        _rotate(ckpt_dir, keep_last)
    dist.barrier()
    return tag


def _rotate(ckpt_dir: Path, keep_last: int) -> None:
    tags = sorted(p for p in ckpt_dir.glob(f"{TAG_PREFIX}*") if p.is_dir())
    for old in tags[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_tag(ckpt_dir: Path) -> Optional[str]:
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag if (ckpt_dir / tag).is_dir() else None


def load(engine, ckpt_dir: Path) -> int:
    """Restore the latest checkpoint into `engine`; returns the number of completed steps."""
    import deepspeed.comm as dist

    tag = latest_tag(ckpt_dir)
    _, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    rng_file = ckpt_dir / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(client_state["step"])


def has_checkpoint(ckpt_dir: Path) -> bool:
    return latest_tag(ckpt_dir) is not None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)

"""Model checkpoints through DeepSpeed's engine: written crash-safe with per-rank RNG state, checked for damage, read back.

Not to be confused with activation checkpointing (see `memtrain.recompute`).

Saves are crash-safe: every rank writes into a hidden temporary directory, and only when all
ranks are done does rank 0 rename it to `stepNNNNNNNN` and then replace `latest` atomically.
A process killed mid-save leaves at most a `.tmp-*` directory, which the next save removes;
a `step*` directory therefore holds a complete checkpoint as written. What happened to it since
(a truncated copy, a full disk, a deleted shard) is checked by `resume_point`, which skips damaged
checkpoints and names their bad files.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
import json

import numpy as np
import torch

from memtrain.errors import UserError

TAG_PREFIX = "step"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"  # a checkpoint that `--resume` found damaged and skipped


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


def weights_finite(engine) -> bool:
    """Every parameter element on every rank is finite: one max-abs per local tensor (torch._foreach_norm with
    ord=inf, which cannot overflow as a 2-norm can), one all-reduce of the count of bad tensors, one host read.
    Run before a save only, never per step. Under ZeRO-3 a rank's parameters are its partitions (`ds_tensor`).
    A 4-bit base's packed weights (bitsandbytes' Params4bit, which carry a quant_state) are codes, not numbers, and
    frozen: skipped."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    by_device: dict = {}
    for p in engine.module.parameters():
        if hasattr(p, "quant_state"):
            continue
        local = getattr(p, "ds_tensor", None)
        local = p.data if local is None else local
        if local.numel():
            by_device.setdefault(local.device, []).append(local)
    bad = torch.zeros((), device=engine.device)
    for tensors in by_device.values():
        norms = torch.stack(torch._foreach_norm(tensors, float("inf")))
        bad += (~torch.isfinite(norms)).sum().to(engine.device)
    dist.all_reduce(bad)
    return bad.item() == 0


ADAM_BYTES_PER_PARAM = 12  # DeepSpeed's fp32 master copy and Adam's two fp32 moments


UNIVERSAL = "universal"  # in a step directory: that checkpoint in DeepSpeed's universal format (train/reshard.py)


def dir_bytes(directory: Path) -> int:
    """A checkpoint's bytes as saved (its universal copy, made for a resume on another world size, not counted)."""
    universal = directory / UNIVERSAL
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and universal not in f.parents)


def space_needed(engine, checkpoint_dir: Path, tp_size: int = 1) -> tuple[int, str]:
    """The bytes the next model checkpoint takes and how that is known: the newest one's size (exact: the same
    model and optimizer), else per parameter its copy in the model's dtype plus Adam's fp32 states."""
    latest = latest_path(checkpoint_dir)
    if latest is not None:
        return dir_bytes(latest), f"the size of {latest.name}"
    params = list(engine.module.parameters())
    n = sum(getattr(p, "ds_numel", p.numel()) for p in params) * tp_size
    zero3 = any(hasattr(p, "ds_numel") for p in params)  # ZeRO-3 saves no module weights, only the states
    per_param = ADAM_BYTES_PER_PARAM + (0 if zero3 else params[0].element_size())
    return n * per_param, f"{n:,} parameters x {per_param} bytes"


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem that holds `directory` (or its nearest existing parent)."""
    while not directory.exists():
        directory = directory.parent
    return shutil.disk_usage(directory).free


def is_disk_full(e: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC/EDQUOT, or torch.save's own words for a short write."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, RuntimeError) and bool(re.search(r"No space left|unexpected pos|failed writing|"
                                                          r"file write failed|Disk quota", str(e)))


def remove_partial(checkpoint_dir: Path, step: int) -> None:
    """Remove a save that did not complete (its temporary directory)."""
    shutil.rmtree(checkpoint_dir / f"{TMP_PREFIX}{tag_for(step)}", ignore_errors=True)


MANIFEST = "manifest.json"  # in each step directory: the world it was saved by, so a missing rank's files show


def save(engine, checkpoint_dir: Path, step: int, keep_last: int, tp_size: int = 1,
         samples: Optional[int] = None) -> str:
    """Save model, optimizer, scheduler and RNG state after `step` completed steps, which read `samples` global
    samples (memtrain.model.order: where a resume on another batch size continues)."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    rank = dist.get_rank()
    tag, tmp_tag = tag_for(step), f"{TMP_PREFIX}{tag_for(step)}"
    if rank == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in checkpoint_dir.glob(f"{TMP_PREFIX}*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(checkpoint_dir), tag=tmp_tag, client_state={"step": step}, save_latest=False)
    torch.save(_rng_state(), checkpoint_dir / tmp_tag / f"rng_rank{rank}.pt")
    if rank == 0:  # what a complete checkpoint of this run holds: every rank's files (`damage`)
        atomic_write_text(checkpoint_dir / tmp_tag / MANIFEST,
                          json.dumps({"world_size": dist.get_world_size(), "tp_size": tp_size}
                                     | ({} if samples is None else {"samples": samples})))
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        final = checkpoint_dir / tag
        if final.exists():  # the same step saved again (e.g. a resumed run preempted at once)
            old = checkpoint_dir / f"{TMP_PREFIX}old-{tag}"
            os.replace(final, old)
            os.replace(checkpoint_dir / tmp_tag, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(checkpoint_dir / tmp_tag, final)
        atomic_write_text(checkpoint_dir / "latest", tag)  # read by DeepSpeed's own tools (zero_to_fp32.py)
        _rotate(checkpoint_dir, keep_last)
    dist.barrier()
    return tag


def _tags(checkpoint_dir: Path) -> list[str]:
    """Complete checkpoints, oldest first (a `step*` directory only appears by rename)."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p.name for p in checkpoint_dir.glob(f"{TAG_PREFIX}*") if p.is_dir())


def _rotate(checkpoint_dir: Path, keep_last: int) -> None:
    for old in _tags(checkpoint_dir)[:-keep_last]:
        shutil.rmtree(checkpoint_dir / old, ignore_errors=True)


def latest_tag(checkpoint_dir: Optional[Path]) -> Optional[str]:
    """The newest complete checkpoint. Not `latest`: a kill between rename and its update is harmless."""
    tags = _tags(checkpoint_dir) if checkpoint_dir is not None else []
    return tags[-1] if tags else None


def latest_path(checkpoint_dir: Optional[Path]) -> Optional[Path]:
    tag = latest_tag(checkpoint_dir)
    return checkpoint_dir / tag if tag else None


def chosen_point(checkpoint_dir: Path) -> "ResumePoint":
    """The checkpoint every rank resumes from: rank 0's choice, after reading every file's zip directory (a node
    whose view of the directory is stale cannot load another step; no other rank opens a file it does not load)."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    chosen = [resume_point(checkpoint_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def load(engine, checkpoint_dir: Path, point: Optional["ResumePoint"] = None) -> int:
    """Restore the newest intact checkpoint (`chosen_point`, or `point` where the caller chose it so) into `engine`;
    returns the number of completed steps. A checkpoint saved by another world size loads from its universal copy
    (`<tag>/universal`, made by memtrain.train.reshard) with DeepSpeed's `load_universal` on for that load."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    point = point or chosen_point(checkpoint_dir)
    tag = point.tag
    if point.world_size == dist.get_world_size():
        # a 4-bit base's saved module state holds bitsandbytes' quant-state entries beside each weight, which its
        # Linear4bit does not load (the base is frozen and quantized again the same way; preflight checked the names)
        strict = not any(hasattr(p, "quant_state") for p in engine.module.parameters())
        _, client_state = engine.load_checkpoint(str(checkpoint_dir), tag=tag, load_module_strict=strict)
    else:
        client_state = _load_universal(engine, checkpoint_dir / tag)
    rng_file = checkpoint_dir / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    dist.barrier()  # every rank has chosen and read the same checkpoint
    if dist.get_rank() == 0:  # damaged newer ones: kept for inspection, out of the way of saves and rotation
        for skipped, _ in point.skipped:
            target, n = checkpoint_dir / f"{DAMAGED_PREFIX}{skipped}", 1
            while target.exists():
                target, n = checkpoint_dir / f"{DAMAGED_PREFIX}{skipped}.{n}", n + 1
            os.replace(checkpoint_dir / skipped, target)
    return int(client_state["step"])


def _load_universal(engine, step_dir: Path) -> dict:
    """DeepSpeed's universal loading (config key checkpoint.load_universal), set on the engine's config for this
    load only: each rank takes its new ZeRO partition of every parameter and optimizer state from the whole
    tensors in `step_dir/universal/zero`; the scheduler and step counter come from its model states file."""
    config = engine._config  # DeepSpeed reads the flag there (engine.load_universal_checkpoint())
    config.load_universal_checkpoint = True
    try:
        _, client_state = engine.load_checkpoint(str(step_dir), tag=UNIVERSAL)
    finally:
        config.load_universal_checkpoint = False
    return client_state


def has_checkpoint(checkpoint_dir: Optional[Path]) -> bool:
    return latest_tag(checkpoint_dir) is not None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- checks before resuming

_RANK_FILE = re.compile(r"(?:rng_rank|zero_pp_rank_)(\d+)")


def _unreadable(path: Path) -> Optional[str]:
    """Why a torch.save file cannot be loaded, judged from its zip directory (at the file's end, so
    a truncated or emptied file fails; reading the directory costs nothing even for large shards)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty"
        with zipfile.ZipFile(path) as z:
            if not z.namelist():
                return "no records"
    except (OSError, zipfile.BadZipFile) as e:
        return f"truncated or corrupt ({size} bytes: {e})" if isinstance(e, zipfile.BadZipFile) else str(e)
    return None


def damage(step_dir: Path, open_files: bool = True) -> list[str]:
    """What is wrong with one saved checkpoint: unreadable files (each file's zip directory read: `open_files`), a
    rank without its files (the manifest's world; a checkpoint saved without one: the ranks whose files are
    there). [] = intact."""
    files = sorted(step_dir.glob("*.pt"))
    if not any(f.name.endswith("model_states.pt") for f in files):
        return ["no model states file" + ("" if files else " (the directory holds no checkpoint file)")]
    bad = [f"{f.name} ({why})" for f in files if (why := _unreadable(f))] if open_files else []
    world, tp = _manifest(step_dir)
    if world is None:
        ranks = {int(m.group(1)) for f in files if (m := _RANK_FILE.match(f.name))}
        world = max(ranks, default=-1) + 1
    present = {f.name for f in files}
    for name in [f"rng_rank{rank}.pt" for rank in range(world)] + _shard_names(files, world, tp):
        if name not in present:
            bad.append(f"{name} (missing)")
    return bad


def _manifest(step_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """(world size, tensor-parallel size) the checkpoint was saved with; (None, None) without a readable manifest."""
    try:
        record = json.loads((step_dir / MANIFEST).read_text())
        return int(record["world_size"]), int(record["tp_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


_SHARD_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(.+)$")


def _shard_names(files: list[Path], world: int, tp: Optional[int] = None) -> list[str]:
    """The ZeRO shard files a checkpoint of `world` ranks must hold, in DeepSpeed's own layout: one set per
    (data-parallel rank, model-parallel rank), `zero_pp_rank_{dp}_mp_rank_{mp:02d}_*`, of the kinds that
    (0, 0) has. The model-parallel (tensor-parallel) size is `tp` (the manifest's), else the number of mp ranks
    present; the data-parallel size is the world over it."""
    shards = [m for f in files if (m := _SHARD_FILE.match(f.name))]
    if not shards:
        return []
    mp_size = tp or max(int(m.group(2)) for m in shards) + 1
    width = len(shards[0].group(2))
    kinds = sorted({m.group(3) for m in shards if int(m.group(1)) == 0 and int(m.group(2)) == 0})
    return [f"zero_pp_rank_{dp}_mp_rank_{mp:0{width}d}_{kind}"
            for dp in range(max(world // mp_size, 1)) for mp in range(mp_size) for kind in kinds]


def saved_samples(step_dir: Path) -> Optional[int]:
    """The global samples read before the checkpoint was saved; None for one saved before memtrain recorded it."""
    try:
        return int(json.loads((step_dir / MANIFEST).read_text())["samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_world_size(step_dir: Path) -> int:
    return _manifest(step_dir)[0] or len(list(step_dir.glob("rng_rank*.pt")))


def saved_tp_size(step_dir: Path) -> int:
    """The tensor-parallel size a checkpoint was saved with: DeepSpeed writes one `mp_rank_XX` per TP rank."""
    return len({m.group(1) for f in step_dir.glob("*.pt") if (m := re.search(r"mp_rank_(\d+)", f.name))}) or 1


@dataclass
class ResumePoint:
    tag: str
    step: int
    world_size: int
    skipped: list[tuple[str, list[str]]] = field(default_factory=list)  # newer damaged checkpoints, bad files
    notes: list[str] = field(default_factory=list)  # other damage found on the way (a cut config.json)

    def warnings(self, checkpoint_dir: Path) -> list[str]:
        return self.notes + [f"--resume: model checkpoint {checkpoint_dir / tag} is damaged ({'; '.join(bad)}); skipped, "
                f"resuming from {self.tag}; it is moved to {DAMAGED_PREFIX}{tag}" for tag, bad in self.skipped]


def resume_point(checkpoint_dir: Path, open_files: bool = True) -> ResumePoint:
    """The newest intact checkpoint; damaged newer ones are skipped (and named), never deleted. Without
    `open_files`, by the files' names only (a rank other than 0, whose choice rank 0's replaces: `load`)."""
    skipped = []
    for tag in reversed(_tags(checkpoint_dir)):
        bad = damage(checkpoint_dir / tag, open_files)
        if not bad:
            return ResumePoint(tag, int(tag[len(TAG_PREFIX):]), saved_world_size(checkpoint_dir / tag), skipped)
        skipped.append((tag, bad))
    if skipped:
        tag, bad = skipped[0]
        raise UserError(f"--resume: no intact model checkpoint in {checkpoint_dir}; the newest, {checkpoint_dir / tag}, "
                        f"is damaged: {'; '.join(bad)}" + (f" (and {len(skipped) - 1} older ones)" if len(skipped) > 1
                                                           else ""))
    raise UserError(f"--resume: no complete model checkpoint in {checkpoint_dir}")

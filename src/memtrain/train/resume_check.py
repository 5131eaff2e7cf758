"""Is a run directory fit for `--resume`: an intact model checkpoint, the same world size (or another that
memtrain.train.reshard converts for), steps left to train, and a recipe whose model has the checkpoint's
parameter shapes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from memtrain.errors import UserError, is_rank_zero
from memtrain.units import GIB
from memtrain.train import checkpoint, reshard
from memtrain.train.run_dir import CHECKPOINTS, RunDir


def check_resume(run_dir: Path, world_size: int, max_steps: int, recipe=None,
                 ds_config: Optional[dict] = None) -> checkpoint.ResumePoint:
    """The checkpoint to resume from, or one line why not; with the launch's `recipe` and `ds_config`, a checkpoint
    of another world size is accepted where memtrain.train.reshard can convert it (else refused)."""
    layout = RunDir(Path(run_dir))
    checkpoint_dir = layout.checkpoints
    if not checkpoint.has_checkpoint(checkpoint_dir) and checkpoint.has_checkpoint(layout.aside / CHECKPOINTS):
        raise UserError(f"--resume: no model checkpoint in {checkpoint_dir}; an interrupted --overwrite left the earlier "
                        f"run in {layout.aside}: move its entries back into {run_dir} to resume it")
    # rank 0 (and the one-process preflight) reads every file's zip directory and decides; the other ranks check
    # names only (hundreds of ranks opening every shard would be ~world^2 opens) and load rank 0's choice
    # (checkpoint.load): where a damaged file makes rank 0 choose an older step, theirs would differ, so what follows
    # from the choice (finished? room for the next save?) is rank 0's to say
    rank0 = is_rank_zero()
    point = checkpoint.resume_point(checkpoint_dir, open_files=rank0)
    if recipe is not None:  # another world size: through DeepSpeed's universal checkpoint, where it can
        reshard.check(checkpoint_dir / point.tag, point.world_size, world_size, recipe, ds_config)
    elif point.world_size != world_size:
        raise UserError(f"--resume: {checkpoint_dir / point.tag} was saved by {point.world_size} ranks, this launch has "
                        f"{world_size}; ZeRO checkpoints are per rank, relaunch with {point.world_size}")
    if not rank0:
        return point
    config = layout.config_file
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:  # the world size comes from the checkpoint; the inputs from this command line
        point.notes.append(f"--resume: {config} is damaged ({str(e).splitlines()[0]}), so the run's own recipe and JSON "
                           "are unknown: this segment runs with this launch's flags as given, and config.json is "
                           "rewritten from them")
    latest, free = checkpoint_dir / point.tag, checkpoint.free_bytes(checkpoint_dir)
    needed = checkpoint.dir_bytes(latest)
    if free < needed and point.step < max_steps:  # its next save would not fit
        raise UserError(f"--resume: disk full: {checkpoint_dir} has {free / GIB:.2f} GiB free and a model checkpoint "
                        f"of this run takes {needed / GIB:.2f} GiB (the size of {point.tag}, which stays intact); "
                        "free space first")
    if point.step >= max_steps and not (point.step == max_steps and _summary(run_dir).get("status") != "completed"):
        # (stopped on its last step, preempted or killed before its summary (a sweep's rerun removes a preempted
        # point's summary.json): the resume runs no step and completes the run: final/, summary.json)
        raise UserError(f"--resume: {run_dir} has finished: {_status(run_dir)}its model checkpoint is at step "
                        f"{point.step} and train.max_steps is {max_steps}; its results are kept as they are "
                        "(pass a larger --max-steps to train further, or use a new --run-dir)")
    return point


def _summary(run_dir: Path) -> dict:
    try:
        summary = json.loads(RunDir(Path(run_dir)).summary_file.read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _status(run_dir: Path) -> str:
    summary = _summary(run_dir)
    if "status" not in summary or "steps" not in summary:
        return ""
    return f"summary.json says {summary['status']} after {summary['steps']} steps; "


def check_shapes(step_dir: Path, model, packed: Optional[dict] = None) -> None:
    """The checkpoint's parameters must be the model's, name for name and shape for shape (`packed`: a 4-bit base's
    weights, any of the shapes bitsandbytes packs them in: memtrain.model.quantize.packed_shapes).

    DeepSpeed records every trained parameter's shape in the model states file (`param_shapes`) and, under
    ZeRO-2/3, every frozen one's (`frozen_param_shapes`: train.frozen, LoRA's base weights); it is loaded
    memory-mapped, so large weights stored beside it are not read."""
    path = sorted(step_dir.glob("*model_states.pt"))[0]
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # a damaged pickle inside an intact zip
        raise UserError(f"--resume: {path}: cannot be read ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                        ) from None
    saved: dict[str, tuple] = {}
    for group in state.get("param_shapes") or [{k: v.shape for k, v in (state.get("module") or {}).items()}]:
        saved.update({k: tuple(v) for k, v in group.items()})
    frozen = state.get("frozen_param_shapes") or {}
    for group in (frozen if isinstance(frozen, list) else [frozen]):
        saved.update({k: tuple(v) for k, v in group.items()})
    ours = {k: tuple(p.shape) for k, p in model.named_parameters()}
    tp = checkpoint.saved_tp_size(step_dir)  # a TP run records each rank's shard of a parameter
    for name, shape in ours.items():
        if name not in saved:
            raise UserError(f"--resume: {path}: has no parameter '{name}', which this recipe's model has; "
                            "the recipe's model differs from the run's (model.*)")
        if saved[name] != shape and not _shard_of(saved[name], shape, tp) and \
                saved[name] not in (packed or {}).get(name, ()):
            raise UserError(f"--resume: {path}: '{name}' has shape {list(saved[name])} in the model checkpoint "
                            f"but {list(shape)} in this recipe's model; the recipe's model differs from the run's (model.*)")
    extra = sorted(set(saved) - set(model.state_dict()))  # a state dict (stage 0) also holds buffers
    if extra:
        raise UserError(f"--resume: {path}: holds '{extra[0]}', which this recipe's model has not"
                        f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; the recipe's model differs "
                        "from the run's (model.*)")


def _shard_of(local: tuple, full: tuple, tp: int) -> bool:
    """`local` is one tensor-parallel rank's shard of a `full` parameter: the same but for one dimension, split
    into `tp` parts (AutoTP splits a column-parallel weight's rows, a row-parallel one's columns)."""
    if tp <= 1 or len(local) != len(full):
        return False
    differ = [i for i, (a, b) in enumerate(zip(local, full)) if a != b]
    return len(differ) == 1 and -(-full[differ[0]] // tp) >= local[differ[0]] >= full[differ[0]] // tp

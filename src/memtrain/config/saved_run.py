"""What `--resume` continues: the recipe and DeepSpeed JSON a run directory's config.json saved, and the changes a
resume's command line makes to them (listed, or refused where they change what a model checkpoint holds)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import UserError

CONFIG_FILE = "config.json"  # in the run directory: every value a run segment used (memtrain.train.trainer)
# where DeepSpeed's monitors write in the run directory (their job_name: memtrain.config.ds_config)
TENSORBOARD_DIR = "tb"
CSV_DIR = "csv"

# Keys whose change alters what a model checkpoint holds (its parameters, their shapes or their partitioning):
# a resume that changes one would fail inside DeepSpeed's load with a tensor-size error, or load wrong state.
# (model.config is not one: most of its keys change no parameter (dropout, rope scaling, attention implementation),
# and the checkpoint's recorded shapes catch those that do: memtrain.train.resume_check.check_shapes.)
CHECKPOINT_KEYS = ("recipe: model.type", "recipe: model.lora", "recipe: model.dtype",
                   "recipe: train.trainable", "recipe: train.frozen", "recipe: parallel.sequence",
                   "deepspeed: zero_optimization.stage", "deepspeed: tensor_parallel")


@dataclass(frozen=True)
class SavedRun:
    """The inputs a run directory's first segment (and every later one) trained with."""

    path: Path  # its config.json
    recipe: dict  # the validated recipe, every key (Recipe.model_dump)
    ds_config: Optional[dict]  # the DeepSpeed JSON as written; None in a config.json older than this key
    ds_config_path: str
    world_size: Optional[int] = None  # the ranks its last segment ran on


def read_saved(run_dir: Path) -> Optional[SavedRun]:
    """The run's saved inputs; None where config.json is missing or damaged (the resume check says so)."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("recipe"), dict):
        return None
    written = record.get("deepspeed_as_written")
    world = record.get("world_size")
    return SavedRun(path, record["recipe"], written if isinstance(written, dict) else None,
                    str(record.get("deepspeed_path") or ""), world if isinstance(world, int) else None)


def changes(before: dict, after: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, before, after) for every leaf that differs; a key missing on one side is None there."""
    out = []
    for key in sorted(set(before) | set(after), key=str):
        a, b = before.get(key), after.get(key)
        dotted = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, dotted + ".")
        elif _plain(a) != _plain(b):
            out.append((dotted, a, b))
    return out


def _plain(value: Any) -> Any:
    """Compare as JSON holds it: a tuple and the list config.json made of it are one value."""
    return json.loads(json.dumps(value, default=str))


def _shown(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value, default=str) if not isinstance(value, str) else value


def resume_changes(saved: SavedRun, recipe: dict, ds_config: dict) -> list[str]:
    """What this launch changes of the saved run, one entry a key ('recipe: train.max_steps 60 -> 80'); one line,
    before anything is written, where a change alters what the run's model checkpoint holds."""
    found = [(f"recipe: {k}", a, b) for k, a, b in changes(saved.recipe, recipe)]
    if saved.ds_config is not None:
        found += [(f"deepspeed: {k}", a, b) for k, a, b in changes(saved.ds_config, ds_config)]
    for key, a, b in found:
        if any(key == k or key.startswith(k + ".") for k in CHECKPOINT_KEYS):
            where, _, name = key.partition(": ")
            flag = "--set" if where == "recipe" else "--deepspeed"
            raise UserError(f"--resume: {name}: {_shown(a)} -> {_shown(b)} ({flag}) changes what the run's model "
                            f"checkpoints hold; keep the run's value ({saved.path}) or train into a new --run-dir")
    return [f"{key} {_shown(a)} -> {_shown(b)}" for key, a, b in found]


GRAD_ACCUM = "train.grad_accum_steps"


def kept_global_batch(saved: SavedRun, ds_config: dict, world: int, overrides: list[str]) -> Optional[int]:
    """The train.grad_accum_steps that keeps the run's global batch (and so its per-step samples and the data's
    order, memtrain.model.order) on `world` ranks instead of the saved ones; None where the world is the same,
    the user set it (--set), the JSON fixes the batch, or no whole number does."""
    if saved.world_size is None or saved.world_size == world or any(o.startswith(GRAD_ACCUM + "=") for o in overrides):
        return None
    if any(ds_config.get(k, "auto") != "auto" for k in ("gradient_accumulation_steps", "train_batch_size")):
        return None
    accum = saved.recipe.get("train", {}).get("grad_accum_steps")
    if not isinstance(accum, int) or accum * saved.world_size % world:
        return None  # (the data-parallel size scales with the world: TP and Ulysses sizes cannot change on resume)
    return accum * saved.world_size // world

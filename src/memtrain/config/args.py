"""`src/train.py`'s command line: flags -> `RunArgs` (recipe, DeepSpeed JSON, run directory)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memtrain.errors import ArgumentParser, UserError
from memtrain.config.recipe import Recipe, load_recipe
from memtrain.config.ds_config import load_ds_config
from memtrain.config.saved_run import GRAD_ACCUM, SavedRun, kept_global_batch, read_saved, resume_changes

DEFAULT_DS_CONFIG = "ds_configs/zero3_ckpt.json"


@dataclass
class RunArgs:
    recipe: Recipe
    ds_config: dict  # as written by the user ("auto" values not yet filled)
    ds_config_path: str
    run_dir: Optional[Path]
    resume: bool
    overwrite: bool
    recipe_path: Optional[str] = None  # None: the embedded default recipe
    world_size: Optional[int] = None  # --world-size of the tools that check a run before it starts
    resume_changes: tuple[str, ...] = ()  # --resume: what this launch changes of the run's saved inputs


def _path(text: str) -> Path:
    if not text.strip():  # Path("") is ".": the run would write into the current directory
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)


TRAIN_DESCRIPTION = "Train a transformers causal LM with DeepSpeed and per-layer activation recompute."


def parser(prog: str = "src/train.py", description: str = TRAIN_DESCRIPTION,
           world_size: Optional[int] = None) -> argparse.ArgumentParser:
    """train.py's flags; with `world_size` (its default) also `--world-size`, for the tools that check or explain a
    run before any launcher starts it (preflight, explain-config), so their --help lists every flag they take."""
    p = ArgumentParser(prog=prog, description=description)
    if world_size is not None:
        p.add_argument("--world-size", type=int, default=world_size,
                       help=f"ranks the run will have, all nodes together (default: {world_size})")
    p.add_argument("--deepspeed", metavar="JSON",
                   help=f"DeepSpeed config (default: {DEFAULT_DS_CONFIG}; with --resume, the run's own)")
    p.add_argument("--recipe", metavar="YAML",
                   help="recipe file (default: the embedded tiny recipe; with --resume, the run's own)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe key, e.g. --set activation_checkpointing.policy=every:2")
    p.add_argument("--run-dir", type=_path, help="run directory (default: runs/<recipe>-<timestamp>)")
    p.add_argument("--max-steps", type=int, help="shorthand for --set train.max_steps=N")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its latest model checkpoint, with the recipe and JSON it "
                        "was started with; flags given change them (listed in one line)")
    p.add_argument("--overwrite", action="store_true", help="allow reusing a run directory that holds a run")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)), help=argparse.SUPPRESS)
    return p


def preflight_parser() -> argparse.ArgumentParser:
    """`python -m memtrain preflight`'s flags: train.py's and --world-size (default: the launcher's WORLD_SIZE)."""
    return parser("python -m memtrain preflight", "Every check of a run before any worker starts, and the corpus "
                  "packed for its workers; silent with exit 0 when all is well.",
                  world_size=int(os.environ.get("WORLD_SIZE", 1)))


def parse_args(argv: Optional[list[str]] = None, flags: Optional[argparse.ArgumentParser] = None) -> RunArgs:
    """`flags`: the parser (default train.py's)."""
    args = (flags or parser()).parse_args(argv)
    world_size = getattr(args, "world_size", None)
    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size: must be positive (got {world_size})")
    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.resume and args.run_dir is None:
        raise UserError("--resume: needs --run-dir naming the run to continue")
    saved = read_saved(args.run_dir) if args.resume else None
    if saved is None:
        ds_path = args.deepspeed or DEFAULT_DS_CONFIG
        return RunArgs(load_recipe(args.recipe, overrides), load_ds_config(ds_path), ds_path, args.run_dir,
                       args.resume, args.overwrite, args.recipe, world_size)
    return _resumed(args, overrides, saved, world_size)


def _resumed(args: argparse.Namespace, overrides: list[str], saved: SavedRun, world_size: Optional[int]) -> RunArgs:
    """--resume continues the run that was started: its saved recipe and JSON, changed only by what this command line
    gives (a --recipe or --deepspeed file replaces the saved one; --set and --max-steps apply on top)."""
    ds_path = args.deepspeed or saved.ds_config_path or DEFAULT_DS_CONFIG
    # a config.json older than deepspeed_as_written: the JSON is read again from where the run read it
    ds_config = load_ds_config(ds_path) if args.deepspeed or saved.ds_config is None else saved.ds_config
    # another world size: the global batch kept where it can be (the next steps read what a straight run would)
    world = world_size or int(os.environ.get("WORLD_SIZE", 1))
    accum = None if args.recipe else kept_global_batch(saved, ds_config, world, overrides)
    if accum is not None:
        overrides = [*overrides, f"{GRAD_ACCUM}={accum}"]
    recipe = load_recipe(args.recipe, overrides, saved=(f"{saved.path}'s recipe", saved.recipe))
    found = resume_changes(saved, recipe.model_dump(), ds_config)
    if accum is not None:
        found = [f"{c} (keeps the global batch on {world} ranks instead of {saved.world_size}; --set "
                 f"{GRAD_ACCUM}=N to choose)" if c.startswith(f"recipe: {GRAD_ACCUM} ") else c for c in found]
    return RunArgs(recipe, ds_config, ds_path, args.run_dir, True, args.overwrite,
                   args.recipe or f"{saved.path}'s recipe", world_size, tuple(found))



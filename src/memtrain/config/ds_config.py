"""DeepSpeed JSON: load, check, and fill recipe-dependent "auto" values.

As with transformers' DeepSpeed integration, values such as batch sizes, learning rate
and schedule length may be written as "auto" in the JSON; they are filled from the recipe
so the two files cannot disagree. Everything else is passed to DeepSpeed untouched.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from memtrain.errors import UserError
from memtrain.config.recipe import Recipe

AUTO = "auto"


def load_ds_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: DeepSpeed config not found")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{p}: a DeepSpeed config must be a JSON object")
    return cfg


def bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def _fill(cfg: dict, dotted: str, value: Any, *, if_missing: bool = False) -> None:
    """Replace an "auto" value (or a missing one when if_missing) at a dotted path."""
    *parents, leaf = dotted.split(".")
    node = cfg
    for k in parents:
        if not isinstance(node.get(k), dict):
            if not if_missing:
                return
            node[k] = {}
        node = node[k]
    if node.get(leaf, AUTO if if_missing else None) == AUTO:
        node[leaf] = value


def zero_stage(cfg: dict) -> int:
    return int(_get(cfg, "zero_optimization.stage", 0) or 0)


def resolve_ds_config(raw: dict, recipe: Recipe, world_size: int, run_dir: Path, num_ac_layers: int) -> dict:
    """Return a copy of the DeepSpeed JSON with every recipe-dependent "auto" value filled."""
    cfg = copy.deepcopy(raw)
    t = recipe.train
    _fill(cfg, "train_micro_batch_size_per_gpu", t.micro_batch_size, if_missing=True)
    _fill(cfg, "gradient_accumulation_steps", t.grad_accum_steps, if_missing=True)
    _fill(cfg, "train_batch_size", t.micro_batch_size * t.grad_accum_steps * world_size, if_missing=True)
    _fill(cfg, "gradient_clipping", t.grad_clip)
    _fill(cfg, "optimizer.params.lr", t.lr)
    _fill(cfg, "optimizer.params.weight_decay", t.weight_decay)
    # "auto": torch's AdamW (the same math as DeepSpeed's FusedAdam), fused on a GPU, so that no
    # launch JIT-builds a DeepSpeed op. An offloaded optimizer keeps DeepSpeed's CPU Adam.
    if _get(cfg, "optimizer.params.torch_adam") == AUTO:
        offloaded = (_get(cfg, "zero_optimization.offload_optimizer.device") or "none") != "none"
        cfg["optimizer"]["params"]["torch_adam"] = not offloaded
        params = cfg["optimizer"]["params"]
        if not offloaded and torch.cuda.is_available() and "foreach" not in params:
            params.setdefault("fused", True)
    _fill(cfg, "scheduler.params.total_num_steps", t.max_steps)
    _fill(cfg, "scheduler.params.warmup_num_steps", t.warmup_steps)
    _fill(cfg, "scheduler.params.cos_min_ratio", t.min_lr / t.lr)
    _fill(cfg, "bf16.enabled", bf16_supported())
    _fill(cfg, "fp16.enabled", False)
    if isinstance(cfg.get("activation_checkpointing"), dict):  # left out or "auto": from the plan
        _fill(cfg, "activation_checkpointing.number_checkpoints", max(num_ac_layers, 1), if_missing=True)
    cfg.setdefault("steps_per_print", 10**9)  # memtrain logs itself; keep DeepSpeed's stdout quiet
    for monitor, sub in (("tensorboard", "tb"), ("csv_monitor", "csv")):
        if isinstance(cfg.get(monitor), dict):
            cfg[monitor]["output_path"] = str(run_dir)
            cfg[monitor]["job_name"] = sub
    return cfg


def ac_section(cfg: dict) -> dict:
    """The JSON's activation_checkpointing section with DeepSpeed's defaults."""
    section = cfg.get("activation_checkpointing") or {}
    return {
        "partition_activations": bool(section.get("partition_activations", False)),
        "cpu_checkpointing": bool(section.get("cpu_checkpointing", False)),
        "contiguous_memory_optimization": bool(section.get("contiguous_memory_optimization", False)),
        "number_checkpoints": section.get("number_checkpoints"),
        "synchronize_checkpoint_boundary": bool(section.get("synchronize_checkpoint_boundary", False)),
        "profile": bool(section.get("profile", False)),
    }

"""Check a run's inputs before any worker starts: recipe, --set overrides, DeepSpeed JSON, run dir.

`check_run` is the whole check, one code path for every entry point. The trainer calls it in
each worker before distributed init; `python -m memtrain.train.preflight --world-size N <train.py args>`
runs it in a plain process before a launcher starts (`make train` does; any other entry point
can do the same), so a mistake is exactly one stderr line (exit 2) and no worker starts. The recipe schema lives in
`memtrain.recipe`; here are the DeepSpeed JSON and everything that spans files. DeepSpeed's own
config classes (pydantic, like the recipe's) have the last word on the JSON.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from memtrain.train import checkpoint
from memtrain.recompute.policy import ACPlan, build_plan, effective_policy
from memtrain.config.args import RunArgs, parse_args
from memtrain.model.data import _BUILDERS, build_tokenizer, resolve_files
from memtrain.config.ds_config import AUTO, ac_section, resolve_ds_config
from memtrain.errors import UserError, cli_entry
from memtrain.model.build import build_config
from memtrain.config.recipe import DataSection
from memtrain.recompute.partition import with_expected_bytes
from memtrain.train.parallel import check_tensor_parallel, tp_size

# Top-level keys that DeepSpeed 0.19.8's DeepSpeedConfig reads (recorded from its accesses),
# plus sequence_parallel_size (read by the engine). An unknown key close to one of these is a
# typo (error with a suggestion); any other unknown key only warns, as DeepSpeed ignores it.
DEEPSPEED_KEYS = frozenset("""
activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet comms_logger
communication_data_type compile compression_training csv_monitor curriculum_learning data_efficiency
data_types dataloader_drop_last datastates_ckpt disable_allgather disable_python_gc dump_state eigenvalue
elasticity expert_parallel flops_profiler fp16 gradient_accumulation_steps gradient_allreduce_op
gradient_clipping gradient_predivide_factor graph_harvesting hybrid_engine log_level
managed_gradient_accumulation memory_breakdown nebula optimizer pipeline prescale_gradients
progressive_layer_drop quantize_training scheduler seq_parallel_communication_data_type
sequence_parallel_size sparse_attention sparse_gradients steps_per_print tensor_parallel tensorboard
timers torch_autocast train_batch_size train_micro_batch_size_per_gpu use_data_before_expert_parallelism
vocabulary_size wall_clock_breakdown wandb weight_quantization zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer zero_optimization
""".split())
SECTIONS = ("zero_optimization", "activation_checkpointing", "optimizer", "scheduler", "bf16", "fp16",
            "tensorboard", "csv_monitor", "wandb", "comet")
AC_BOOL_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                "synchronize_checkpoint_boundary", "profile")
ZERO_STAGES = (0, 1, 2, 3)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any, minimum: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= minimum


# Values memtrain fills when written "auto": (dotted key, check, what is allowed).
AUTO_KEYS = (
    ("train_batch_size", _positive_int, "a positive integer"),
    ("train_micro_batch_size_per_gpu", _positive_int, "a positive integer"),
    ("gradient_accumulation_steps", _positive_int, "a positive integer"),
    ("gradient_clipping", _number, "a number >= 0"),
    ("optimizer.params.lr", lambda v: _number(v) and v > 0, "a positive number"),
    ("optimizer.params.weight_decay", _number, "a number >= 0"),
    ("scheduler.params.total_num_steps", _positive_int, "a positive integer"),
    ("scheduler.params.warmup_num_steps", lambda v: _number(v) and int(v) == v, "an integer >= 0"),
    ("bf16.enabled", lambda v: isinstance(v, bool), "true or false"),
    ("fp16.enabled", lambda v: isinstance(v, bool), "true or false"),
    ("activation_checkpointing.number_checkpoints", lambda v: v is None or _positive_int(v),
     "a positive integer or null"),
)


@dataclass(frozen=True)
class Checked:
    """What validation built on the way; the trainer uses it rather than building it again."""

    files: list[Path]
    tokenizer: Any
    config: Any  # transformers config
    plan: ACPlan
    warnings: tuple[str, ...]
    memory_plan: Any = None  # policy auto: memtrain.memory.planner.PlanResult (prediction and choice)


def _get(cfg: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False, None
        node = node[k]
    return True, node


def _suggest(key: str, allowed, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=cutoff)
    return f"did you mean '{close[0]}'? " if close else ""


def _hint(key: str, allowed) -> str:
    """A suggestion, and the allowed keys when there are few enough to read."""
    allowed = sorted(allowed)
    listed = f"allowed: {', '.join(allowed)}" if allowed and (len(allowed) <= 12 or not _suggest(key, allowed)) else ""
    return (_suggest(key, allowed) + listed).strip() or "not a known key"


# --------------------------------------------------------------------------- DeepSpeed JSON

def _model_keys(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()} | set(model.model_fields)


def _submodel(model: type[BaseModel], loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model that holds the last key of `loc` (for did-you-mean), if known."""
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        inner = [a for a in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def _pydantic_line(err: ValidationError, source: str, prefix: str, model: type[BaseModel]) -> str:
    e = err.errors()[0]
    loc = tuple(str(p) for p in e["loc"])
    key = ".".join((prefix, *loc)) if prefix else ".".join(loc)
    if e["type"] == "extra_forbidden":
        holder = _submodel(model, loc[:-1])
        return f"{source}: unknown key '{key}'; {_hint(loc[-1], _model_keys(holder) if holder else ())}"
    value = e.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
    return f"{source}: {key}: {e['msg']}{shown}"


def check_ds_json(cfg: dict, source: str) -> list[str]:
    """Keys, types and DeepSpeed's own section schemas; returns warnings."""
    warnings = []
    for key in cfg:
        if key in DEEPSPEED_KEYS:
            continue
        hint = _suggest(key, DEEPSPEED_KEYS, cutoff=0.8)
        if hint:
            raise UserError(f"{source}: unknown key '{key}'; {hint}(DeepSpeed would silently ignore it)")
        warnings.append(f"{source}: '{key}' is not a DeepSpeed config key; DeepSpeed ignores it")
    for section in SECTIONS:
        if section in cfg and not isinstance(cfg[section], dict):
            raise UserError(f"{source}: {section}: expected an object {{...}}, got {json.dumps(cfg[section])}")
    for dotted, ok, allowed in AUTO_KEYS:
        present, value = _get(cfg, dotted)
        if present and value != AUTO and not ok(value):
            raise UserError(f"{source}: {dotted}: expected {allowed} or \"auto\", got {json.dumps(value)}")

    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not (isinstance(stage, int) and not isinstance(stage, bool) and stage in ZERO_STAGES):
        raise UserError(f"{source}: zero_optimization.stage: {json.dumps(stage)} is not a ZeRO stage; "
                        "allowed: 0, 1, 2, 3")
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("tensorboard", TensorBoardConfig),
                           ("csv_monitor", CSVConfig), ("wandb", WandbConfig), ("comet", CometConfig)):
        if section in cfg:
            try:
                model(**cfg[section])
            except ValidationError as e:
                raise UserError(_pydantic_line(e, source, section, model)) from None

    ac = cfg.get("activation_checkpointing")
    if ac is not None:
        allowed = (*AC_BOOL_KEYS, "number_checkpoints")
        for key, value in ac.items():
            if key not in allowed:
                raise UserError(f"{source}: unknown key 'activation_checkpointing.{key}'; {_hint(key, allowed)}")
            if key in AC_BOOL_KEYS and not isinstance(value, bool):
                raise UserError(f"{source}: activation_checkpointing.{key}: expected true or false, "
                                f"got {json.dumps(value)}")
        if ac.get("contiguous_memory_optimization"):
            if not ac.get("partition_activations"):
                raise UserError(f"{source}: activation_checkpointing.contiguous_memory_optimization: needs "
                                "partition_activations: true (DeepSpeed asserts otherwise)")
            if ac.get("number_checkpoints") is None:
                raise UserError(f"{source}: activation_checkpointing.contiguous_memory_optimization: needs "
                                "number_checkpoints (a number or \"auto\"; DeepSpeed asserts otherwise)")
    return warnings


def check_batch(cfg: dict, source: str, recipe, world_size: int) -> None:
    """Explicit JSON batch values must agree with the recipe and the world size."""
    t = recipe.train
    for key, recipe_key, recipe_value in (("train_micro_batch_size_per_gpu", "train.micro_batch_size",
                                           t.micro_batch_size),
                                          ("gradient_accumulation_steps", "train.grad_accum_steps",
                                           t.grad_accum_steps)):
        value = cfg.get(key, AUTO)
        if value != AUTO and value != recipe_value:
            raise UserError(f"{source}: {key}: {value} disagrees with the recipe's {recipe_key}={recipe_value}; "
                            "write \"auto\" or make them equal")
    total = cfg.get("train_batch_size", AUTO)
    expected = t.micro_batch_size * t.grad_accum_steps * world_size
    if total != AUTO and total != expected:
        raise UserError(f"{source}: train_batch_size: {total} != micro batch {t.micro_batch_size} x grad accum "
                        f"{t.grad_accum_steps} x world size {world_size} = {expected}; write \"auto\" or {expected}")


def _recipe_overrides(cfg: dict, source: str, recipe) -> list[str]:
    """Explicit JSON values win over the recipe (only "auto" is filled): legal, but say so."""
    t = recipe.train
    pairs = (("optimizer.params.lr", "train.lr", t.lr), ("optimizer.params.weight_decay", "train.weight_decay",
             t.weight_decay), ("gradient_clipping", "train.grad_clip", t.grad_clip),
             ("scheduler.params.total_num_steps", "train.max_steps", t.max_steps),
             ("scheduler.params.warmup_num_steps", "train.warmup_steps", t.warmup_steps))
    out = []
    for dotted, recipe_key, recipe_value in pairs:
        present, value = _get(cfg, dotted)
        if present and value != AUTO and value != recipe_value:
            out.append(f"{source}: {dotted}={value} overrides the recipe's {recipe_key}={recipe_value}")
    return out


# Scheduler params memtrain fills from the recipe when written "auto".
SCHEDULER_FROM_RECIPE = {"total_num_steps": "train.max_steps", "warmup_num_steps": "train.warmup_steps",
                         "cos_min_ratio": "train.min_lr / train.lr"}


def _optimizer_and_scheduler(raw: dict, resolved: dict, source: str) -> None:
    """The names DeepSpeed resolves, and the scheduler built as the engine will build it."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = resolved.get("optimizer", {}).get("type")
    if "optimizer" in resolved and not (isinstance(name, str) and (
            name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name))):
        raise UserError(f"{source}: optimizer.type: unknown optimizer {json.dumps(name)}; "
                        f"{_hint(str(name), DEEPSPEED_OPTIMIZERS)}")
    if "scheduler" not in resolved:
        return
    name = resolved["scheduler"].get("type")
    cls = (getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
           if isinstance(name, str) else None)
    if not isinstance(cls, type):
        raise UserError(f"{source}: scheduler.type: unknown scheduler {json.dumps(name)}; "
                        f"{_hint(str(name), lr_schedules.VALID_LR_SCHEDULES)}")
    params = resolved["scheduler"].get("params", {})
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    try:
        cls(dummy, **params)
    except Exception as e:  # DeepSpeed's schedulers check their arguments in __init__
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        auto = [f"{k} comes from the recipe's {r}" for k, r in SCHEDULER_FROM_RECIPE.items()
                if k in first and _get(raw, f"scheduler.params.{k}") == (True, AUTO)]
        raise UserError(f"{source}: scheduler.params: DeepSpeed's {name} rejects them: {first}"
                        + (f" ({'; '.join(auto)})" if auto else "")) from None


def deepspeed_accepts(raw: dict, resolved: dict, source: str) -> None:
    """DeepSpeed's own DeepSpeedConfig, as the engine will build it, wrapped to one line."""
    from deepspeed.runtime.config import DeepSpeedConfig

    _optimizer_and_scheduler(raw, resolved, source)

    cfg = copy.deepcopy(resolved)
    cfg.pop("train_batch_size", None)  # checked above against the real world size; here world is 1
    try:
        DeepSpeedConfig(cfg)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(f"{source}: DeepSpeed rejects it ({e.title}): {where}: {first['msg']}") from None
    except Exception as e:  # DeepSpeed reports config mistakes as asserts and ValueErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{source}: DeepSpeed rejects it: {first}") from None


# --------------------------------------------------------------------------- cross-file

def check_text(files: list[Path], data: DataSection) -> None:
    """Data files must hold text: catch empty files before any worker tokenizes them."""
    def usable(f: Path) -> bool:
        size = f.stat().st_size
        if size == 0:
            return False
        if _BUILDERS.get(f.suffix.lower(), "text") == "text" and size < (1 << 16):
            return bool(f.read_text(errors="replace").strip())
        return True

    if not data.paths:
        return
    if not any(usable(f) for f in files):
        raise UserError(f"data.paths: {', '.join(data.paths)}: the {len(files)} matched file(s) hold no text")


def check_run_dir(args: RunArgs, world_size: int) -> None:
    run_dir = args.run_dir
    if args.resume and args.overwrite:
        raise UserError("--overwrite: cannot be combined with --resume (resume continues a run, overwrite deletes it)")
    if args.resume:
        ckpt_dir = run_dir / "checkpoints"
        if not checkpoint.has_checkpoint(ckpt_dir):
            raise UserError(f"--resume: no complete model checkpoint in {ckpt_dir}")
        previous = run_dir / "config.json"
        if previous.is_file():
            was = json.loads(previous.read_text()).get("world_size")
            if was is not None and was != world_size:
                raise UserError(f"--resume: {run_dir} was trained with world size {was}, this launch has "
                                f"{world_size}; ZeRO checkpoints are per rank, relaunch with {was}")
    elif run_dir and not args.overwrite and any(
            (run_dir / name).exists() for name in ("config.json", "summary.json", "checkpoints", "tb")):
        raise UserError(f"--run-dir {run_dir}: already holds a run; pass --resume to continue it "
                        "or --overwrite to replace it")


def check_run(args: RunArgs, world_size: int) -> Checked:
    """Every check, cheapest first; raises UserError on the first mistake."""
    recipe, source = args.recipe, args.ds_config_path
    warnings = check_ds_json(args.ds_config, source)
    check_batch(args.ds_config, source, recipe, world_size)
    check_run_dir(args, world_size)
    recipe_source = args.recipe_path or "embedded recipe 'tiny'"
    try:  # these name a recipe key path; say which recipe too
        files = [] if recipe.data.random_tokens else resolve_files(recipe.data)
        if files:
            check_text(files, recipe.data)
        tokenizer = build_tokenizer(recipe.data.tokenizer)
        config = build_config(recipe.model, tokenizer.vocab_size, recipe.data.seq_len)
        ds_ac = ac_section(args.ds_config)
        policy, memory_plan = effective_policy(recipe.activation_checkpointing, args.ds_config), None
        if policy == "auto":  # per-layer plan that fits activation_checkpointing.memory_budget
            from memtrain.memory.planner import auto_plan

            plan, memory_plan = auto_plan(recipe, args.ds_config, world_size, config)
        else:
            plan = build_plan(policy, recipe.activation_checkpointing.backend, ds_ac, config.num_hidden_layers,
                              model_parallel_size=tp_size(args.ds_config),
                              section=recipe.activation_checkpointing)  # also rejects op-level under reentrant
    except UserError as e:
        raise UserError(f"{recipe_source}: {e}") from None
    check_tensor_parallel(args.ds_config, source, config, world_size)
    resolved = resolve_ds_config(args.ds_config, recipe, 1, Path("runs/validate"), plan.checkpoint_calls)
    deepspeed_accepts(args.ds_config, resolved, source)
    plan = with_expected_bytes(plan, config, recipe, resolved)
    warnings += _recipe_overrides(args.ds_config, source, recipe)
    if memory_plan is None and recipe.activation_checkpointing.memory_budget is not None:
        warnings.append(f"activation_checkpointing.memory_budget is ignored by policy '{plan.policy}' (used by 'auto')")
    return Checked(files, tokenizer, config, plan, tuple(warnings), memory_plan)


# --------------------------------------------------------------------------- CLI

@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    """`python -m memtrain.train.preflight [--world-size N] <train.py args>`: check, and pack the data.

    Silent with exit 0 when everything is fine; the packed corpus is cached for the workers.
    """
    import os

    from memtrain.model.data import prepare_data

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.world_size < 1:
        raise UserError(f"--world-size: must be positive (got {known.world_size})")
    args = parse_args(rest)
    check_run(args, known.world_size)
    if not args.recipe.data.random_tokens:
        prepare_data(args.recipe.data, args.recipe.train.seed)


if __name__ == "__main__":
    main()

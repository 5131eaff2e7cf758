"""The DeepSpeed JSON checked before any worker starts: its keys and types, the batch against the recipe, what
DeepSpeed's own config classes accept, the optimizer and scheduler as the engine builds them, `tensor_parallel`.

Each mistake is one UserError line naming the file and the key. `memtrain.config.ds_checks` holds the checks
that need the machine (dtypes, NVMe, op builds). DeepSpeed's own config classes (pydantic, like the recipe's)
have the last word on the JSON.
"""
from __future__ import annotations

import copy
import difflib
import json
import typing
from contextlib import contextmanager
from typing import Any, Optional

from pydantic import BaseModel, ValidationError
import torch

from memtrain.config import ds_checks
from memtrain.config.ds_config import AUTO, AUTO_KEYS, ac_defaults, deepspeed_top_level_keys, get, has, \
    recipe_disagreements
from memtrain.errors import UserError

SECTIONS = ("zero_optimization", "activation_checkpointing", "optimizer", "scheduler", "bf16", "fp16",
            "tensorboard", "csv_monitor", "wandb", "comet")
ZERO_STAGES = (0, 1, 2, 3)


def check_json(cfg: dict, source: str, recipe, world_size: int) -> list[str]:
    """The JSON's own checks and its batch against the recipe (`check_ds_json`, `check_batch`); returns warnings."""
    warnings = check_ds_json(cfg, source)
    check_batch(cfg, source, recipe, world_size)
    return warnings


def schedule_kwargs(recipe) -> dict:
    """The recipe's schedule as DeepSpeed's WarmupCosineLR arguments (memtrain's own, when the JSON has none)."""
    t = recipe.train
    # DeepSpeed >= 0.19.6 rejects 0 warm-up steps (transformers fills max(1, warmup) too)
    return {"total_num_steps": t.max_steps, "warmup_min_ratio": 0.0, "warmup_num_steps": max(1, t.warmup_steps),
            "cos_min_ratio": t.min_lr / t.lr, "warmup_type": "linear"}


@contextmanager
def silenced():
    """No DeepSpeed log while validation constructs DeepSpeed's objects on dummies."""
    from deepspeed.utils import logger  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


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


# JSON keys DeepSpeed divides by, outside the batch keys (check_batch) and the "auto" table: key -> integer?
DIVISORS = {"steps_per_print": True, "gradient_predivide_factor": False}


def check_ds_json(cfg: dict, source: str) -> list[str]:
    """Keys, types and DeepSpeed's own section schemas; returns warnings."""
    warnings = []
    known = deepspeed_top_level_keys()
    for key in cfg:
        if key in known:
            continue
        hint = _suggest(key, known, cutoff=0.8)
        if hint:
            raise UserError(f"{source}: unknown key '{key}'; {hint}(DeepSpeed would silently ignore it)")
        warnings.append(f"{source}: '{key}' is not a DeepSpeed config key; DeepSpeed ignores it")
    for section in SECTIONS:
        if section in cfg and not isinstance(cfg[section], dict):
            raise UserError(f"{source}: {section}: expected an object {{...}}, got {json.dumps(cfg[section])}")
    for a in AUTO_KEYS:
        present, value = has(cfg, a.key), get(cfg, a.key)
        if present and value != AUTO and not a.check(value):
            raise UserError(f"{source}: {a.key}: expected {a.allowed} or \"auto\", got {json.dumps(value)}")
    ds_checks.check_unfilled_auto(cfg, source)
    for key, integer in DIVISORS.items():  # DeepSpeed divides by these mid-run (a ZeroDivisionError in every worker)
        present, value = has(cfg, key), get(cfg, key)
        if present and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                            and (not integer or float(value).is_integer())):
            raise UserError(f"{source}: {key}: expected a positive {'integer' if integer else 'number'} "
                            f"(DeepSpeed divides by it), got {json.dumps(value)}")

    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not (isinstance(stage, int) and not isinstance(stage, bool) and stage in ZERO_STAGES):
        raise UserError(f"{source}: zero_optimization.stage: {json.dumps(stage)} is not a ZeRO stage; "
                        "allowed: 0, 1, 2, 3")

    ac = cfg.get("activation_checkpointing")
    if ac is not None:
        defaults = ac_defaults()  # DeepSpeed's own keys and defaults
        for key, value in ac.items():
            if key not in defaults:
                raise UserError(f"{source}: unknown key 'activation_checkpointing.{key}'; {_hint(key, defaults)}")
            if isinstance(defaults[key], bool) and not isinstance(value, bool):
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
    for a, value, wanted in recipe_disagreements(cfg, recipe, world_size):
        if not a.must_match:
            continue
        if a.key == "train_batch_size":
            sp = recipe.parallel.sequence
            ranks = f"world size {world_size}" + (f" / parallel.sequence {sp}" if sp > 1 else "")
            raise UserError(f"{source}: train_batch_size: {value} != micro batch {t.micro_batch_size} x grad accum "
                            f"{t.grad_accum_steps} x {ranks} = {wanted}; write \"auto\" or {wanted}")
        raise UserError(f"{source}: {a.key}: {value} disagrees with the recipe's {a.source}={wanted}; "
                        "write \"auto\" or make them equal")


def recipe_overrides(cfg: dict, source: str, recipe, world_size: int = 1) -> list[str]:
    """Explicit JSON values win over the recipe (only "auto" is filled): legal, but say so."""
    return [f"{source}: {a.key}={json.dumps(value)} overrides the recipe's {a.source}={json.dumps(wanted)}"
            for a, value, wanted in recipe_disagreements(cfg, recipe, world_size) if not a.must_match]


def _optimizer_and_scheduler(raw: dict, resolved: dict, source: str, recipe=None) -> None:
    """The names DeepSpeed resolves, and the scheduler built as the engine will build it."""
    from deepspeed.runtime import lr_schedules  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    name = resolved.get("optimizer", {}).get("type")
    if "optimizer" in resolved and not (isinstance(name, str) and (
            name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name))):
        raise UserError(f"{source}: optimizer.type: unknown optimizer {json.dumps(name)}; "
                        f"{_hint(str(name), DEEPSPEED_OPTIMIZERS)}")
    if "scheduler" not in resolved:  # memtrain's own schedule from the recipe (memtrain.train.optimizer)
        if recipe is None:
            return
        try:
            lr_schedules.WarmupCosineLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3),
                                        **schedule_kwargs(recipe))
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"train: the recipe's schedule (warm-up + cosine) is rejected: {first}") from None
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
        auto = [f"{a.key.rpartition('.')[2]} comes from {a.source}" for a in AUTO_KEYS
                if a.key.startswith("scheduler.params.") and a.key.rpartition(".")[2] in first
                and get(raw, a.key) == AUTO]
        raise UserError(f"{source}: scheduler.params: DeepSpeed's {name} rejects them: {first}"
                        + (f" ({'; '.join(auto)})" if auto else "")) from None


def deepspeed_accepts(raw: dict, resolved: dict, source: str, recipe=None) -> None:
    """DeepSpeed's own DeepSpeedConfig, as the engine will build it, wrapped to one line."""
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("tensorboard", TensorBoardConfig),
                           ("csv_monitor", CSVConfig), ("wandb", WandbConfig), ("comet", CometConfig)):
        if section in resolved:
            try:
                model(**resolved[section])
            except ValidationError as e:
                raise UserError(_pydantic_line(e, source, section, model)) from None
    ds_checks.check_optimizer(resolved, source)
    with silenced():  # DeepSpeed's schedulers log warnings while they check
        _optimizer_and_scheduler(raw, resolved, source, recipe)

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
    ds_checks.check_dtype_support(resolved, source)  # after DeepSpeed's own checks (e.g. fp16 and bf16 both on)
    ds_checks.check_nvme(resolved, source)


def check_tensor_parallel(ds_config: dict, source: str, config, world_size: int) -> None:
    """`tensor_parallel` against DeepSpeed's own schema, the world size and the model's heads: one line each."""
    if "tensor_parallel" not in ds_config:
        return
    section = ds_config["tensor_parallel"]
    if not isinstance(section, dict):
        raise UserError(f"{source}: tensor_parallel: expected an object {{...}}, got {json.dumps(section)}")
    size = section.get("autotp_size", 0)
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        raise UserError(f"{source}: tensor_parallel.autotp_size: expected an integer >= 0, got {json.dumps(size)}")
    sub: Any = section.get("tp", {})
    sub_size = sub.get("tp_size", 1) if isinstance(sub, dict) else 1
    if sub_size not in (1, max(size, 1)):  # DeepSpeed raises this at initialize, inside every worker
        raise UserError(f"{source}: tensor_parallel.tp.tp_size: {json.dumps(sub_size)} differs from "
                        f"tensor_parallel.autotp_size {size}; leave it out or make them equal")
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    try:
        TPTrainingConfig(**section)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(f"{source}: tensor_parallel.{where}: {first['msg']}") from None
    if size <= 1:
        return
    if world_size % size:
        raise UserError(f"{source}: tensor_parallel.autotp_size: {size} does not divide the world size {world_size}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value is not None and value % size:
            raise UserError(f"{source}: tensor_parallel.autotp_size: {size} does not divide the model's {name} "
                            f"{value} (AutoTP shards attention by heads)")

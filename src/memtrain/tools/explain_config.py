"""`python -m memtrain explain-config --deepspeed F [--recipe R]`: one line per key of a DeepSpeed
JSON saying what a run does with it: filled from the recipe/model (with the value), in effect, a
no-op here (and why), or rejected (and why). It runs the same preflight as a launch."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from memtrain.config.args import RunArgs, parse_args, parser
from memtrain.config.ds_config import (AUTO, AUTO_BY_KEY, MONITOR_KEYS, deepspeed_top_level_keys, get,
                                       model_hidden_size, recipe_disagreements, resolve_ds_config,
                                       zero_stage)
from memtrain.config.recompute_spec import RecomputeSpec
from memtrain.errors import UserError, cli_entry


def _leaves(cfg: Any, prefix: str = ""):
    if isinstance(cfg, dict) and cfg:
        for k, v in cfg.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, cfg


def _noop(key: str, raw: dict, resolved: dict, spec: Optional[RecomputeSpec]) -> Optional[str]:
    """Why a key does nothing in this run, or None. Kept by hand: DeepSpeed does not say."""
    top, _, rest = key.partition(".")
    if top not in deepspeed_top_level_keys():
        return "not a DeepSpeed key: DeepSpeed ignores it"
    if key in MONITOR_KEYS:
        return "memtrain writes the monitor into the run directory (tb/, csv/)"
    if top in ("fp16", "bf16") and rest != "enabled" and get(resolved, f"{top}.enabled") is not True:
        return f"{top} is off"
    stage = zero_stage(resolved)
    if top == "zero_optimization" and rest != "stage":
        if stage == 0:
            return "ZeRO stage 0 partitions nothing"
        if ("stage3_" in rest or rest.startswith(("offload_param", "sub_group_size"))) and stage < 3:
            return "ZeRO-3 only"
        import torch  # noqa: PLC0415 here, not at the top: --help must not wait for it

        if rest.endswith("pin_memory") and not torch.cuda.is_available():
            return "no device here: nothing to pin for"
    if top == "activation_checkpointing" and spec is not None:  # as the run's RecomputeSpec decided
        value = get(raw, key)
        notes = {n.partition(": ")[0]: n.partition(": ")[2] for n in spec.notes}
        if rest in notes and value is True:
            return notes[rest]
        if rest in ("profile", "synchronize_checkpoint_boundary", "contiguous_memory_optimization") and value is True \
                and spec.backend == "torch":
            return "ignored by the torch backend (recipe activation_checkpointing.backend: deepspeed honours it)"
        if rest == "number_checkpoints" and not spec.contiguous_memory_optimization:
            return "read only by contiguous_memory_optimization, which is off"
    if key == "steps_per_print":
        return "DeepSpeed's own print is off; memtrain logs every train.log_every steps (this value when unset)"
    return None


def explain(args: RunArgs) -> list[str]:
    from memtrain.train.preflight import resolve_run  # noqa: PLC0415 pulls numpy, torch: heavy, kept off --help

    world_size = args.world_size or 1
    raw, source = args.ds_config, args.ds_config_path
    error, checked = None, None
    try:
        checked = resolve_run(args, world_size)
    except UserError as e:
        error = str(e)
    hidden = model_hidden_size(checked.config) if checked else None
    calls = len(checked.plan.offload_units) if checked else 0
    resolved = resolve_ds_config(raw, args.recipe, world_size, Path("<run dir>"), calls, hidden_size=hidden)
    spec = checked.spec if checked else None
    from memtrain.config import ds_checks  # noqa: PLC0415 pulls torch: heavy, kept off --help

    problems = [error] if error else []
    for check in (ds_checks.check_optimizer, ds_checks.check_dtype_support, ds_checks.check_nvme):
        try:  # each on its own, so that every rejected key shows, not only the first
            check(resolved, source)
        except UserError as e:
            problems.append(str(e))
    overrides = {a.key: f"overrides the recipe's {a.source}={json.dumps(wanted)}"
                 for a, _, wanted in recipe_disagreements(raw, args.recipe, world_size) if not a.must_match}
    lines = [f"{source} with {args.recipe_path or 'the embedded recipe'} on {world_size} rank(s):"]
    for key, value in _leaves(raw):
        shown = json.dumps(value)
        hit = next((e for e in problems if f": {key}:" in e or f"'{key}'" in e), None)
        if hit:
            lines.append(f"{key} = {shown}: rejected: {hit.split(': ', 1)[1]}")
        elif value == AUTO and key in AUTO_BY_KEY:
            filled = get(resolved, key)
            how = f"from {AUTO_BY_KEY[key].source}" if filled != AUTO else "filled once the model is known"
            lines.append(f"{key} = \"auto\": filled {json.dumps(filled)} {how}")
        elif value == AUTO and key not in MONITOR_KEYS:
            lines.append(f"{key} = \"auto\": rejected: memtrain cannot fill it")
        else:
            why = _noop(key, raw, resolved, spec)
            lines.append(f"{key} = {shown}: " + (f"no-op here: {why}" if why else "in effect")
                         + (f" ({overrides[key]})" if key in overrides and not why else ""))
    added = sorted(k for k, _ in _leaves(resolved) if get(raw, k, None) is None and k.split(".")[0] != "tensorboard")
    for key in added:
        lines.append(f"{key} (not in the JSON): memtrain sets {json.dumps(get(resolved, key))}")
    if "optimizer" not in raw:
        from memtrain.config.ds_validate import schedule_kwargs  # noqa: PLC0415 pulls torch: heavy, kept off --help
        from memtrain.train.optimizer import optimizer_name  # noqa: PLC0415 pulls torch: heavy, kept off --help

        lines.append(f"optimizer (no section): memtrain builds {optimizer_name(resolved)} from train.lr/adam_betas/"
                     "adam_eps/weight_decay")
        if "scheduler" not in raw:
            lines.append(f"scheduler (no section): memtrain builds WarmupCosineLR {schedule_kwargs(args.recipe)}")
    elif "scheduler" not in raw:
        from memtrain.config.ds_validate import schedule_kwargs  # noqa: PLC0415 pulls torch: heavy, kept off --help

        lines.append(f"scheduler (no section): memtrain builds WarmupCosineLR {schedule_kwargs(args.recipe)}")
    if error:
        lines.append(f"the run is rejected: {error}")
    elif checked:
        lines += [f"warning: {w}" for w in checked.warnings]
    return lines


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    print("\n".join(explain(parse_args(argv, explain_parser()))))


def explain_parser():
    """explain-config's flags: src/train.py's and --world-size (default 2, as make explain's NPROC)."""
    description = " ".join(__doc__.split(":", 1)[1].split())  # the docstring after its usage line
    description = description[0].upper() + description[1:]
    return parser("python -m memtrain explain-config", description, world_size=2)

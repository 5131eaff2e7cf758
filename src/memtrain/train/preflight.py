"""Check a run's inputs before any worker starts: recipe, --set overrides, DeepSpeed JSON, run dir.

`check_run` is the whole check, one code path for every entry point. The trainer calls it in
each worker before distributed init; `python -m memtrain.train.preflight --world-size N <train.py args>`
runs it in a plain process before a launcher starts (`make train` does; any other entry point
can do the same), so a mistake is exactly one stderr line (exit 2) and no worker starts. The recipe schema lives in
`memtrain.recipe`; here are the DeepSpeed JSON and everything that spans files. DeepSpeed's own
config classes (pydantic, like the recipe's) have the last word on the JSON.
"""
from __future__ import annotations

import copy
import difflib
import json
import sys
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from memtrain.train import checkpoint, long_context, reshard
from memtrain.train import run_dir as run_dirs
from memtrain.train.node import agent_ranks, holds_rank0
from memtrain.train.resume_check import check_resume, check_shapes
from memtrain.model.data_check import check_data_files, check_seq_len
from memtrain.recompute.policy import ACPlan, build_plan
from memtrain.config.recompute_spec import RecomputeSpec, resolve_recompute
from memtrain.model.freeze import count_trainable, saved_with_adapters
from memtrain.model.chat_data import check_template
from memtrain.model.lora import add_lora, trainable_patterns
from memtrain.model.moe import experts_line
from memtrain.model.pretrained import check_pretrained
from memtrain.memory.target import compute_dtype
from memtrain.memory.planner import predict_run
from memtrain.units import GIB
from memtrain.config.args import RunArgs, parse_args, preflight_parser
from memtrain.model.data import build_tokenizer, builder_for, resolve_files
from memtrain.model import eval_data
from memtrain.config.ds_config import (AUTO, AUTO_KEYS, ac_defaults, deepspeed_top_level_keys, get, has,
                                       model_hidden_size, recipe_disagreements, resolve_ds_config, zero_stage)
from memtrain.train import ds_checks, ds_log, rng
from memtrain.train.qlora_checks import check_quantized_base
from memtrain.model.quantize import packed_shapes
from memtrain.train.compile_choice import EAGER_PREDICTION, CompileChoice, choose_compile, leaf_names_layer
from memtrain.errors import NodeError, UserError, cli_entry, is_rank_zero
from memtrain.model.build import build_config, build_on_meta, decoder_layers
from memtrain.config.zero3 import Zero3Layout, zero3_layout
from memtrain.recompute.hooks import apply_plan
from memtrain.config.recipe import DataSection, pretrained_tokenizer
from memtrain.recompute.partition import with_expected_bytes
from memtrain.train.parallel import check_autotp_model, check_tensor_parallel
from memtrain.config.ds_config import tp_size

SECTIONS = ("zero_optimization", "activation_checkpointing", "optimizer", "scheduler", "bf16", "fp16",
            "tensorboard", "csv_monitor", "wandb", "comet")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Checked:
    """What validation built on the way; the trainer uses it rather than building it again."""

    files: list[Path]
    tokenizer: Any
    config: Any  # transformers config
    plan: ACPlan
    warnings: tuple[str, ...]
    memory_plan: Any = None  # policy auto: memtrain.memory.planner.PlanResult (prediction and choice)
    zero3: Zero3Layout = Zero3Layout()  # leaf layers and residency under ZeRO-3 (memtrain.config.zero3)
    spec: RecomputeSpec = RecomputeSpec()  # the activation-checkpointing decision (memtrain.config.recompute_spec)
    # plan lines about the model: what trains (memtrain.model.freeze), which expert matmul an MoE runs (model.moe)
    model_lines: tuple[str, ...] = ()
    prediction: Any = None  # memtrain.memory.predict.Prediction of this plan (the auto plan's, for policy auto)
    compile: CompileChoice = CompileChoice()  # train.compile for this run (memtrain.train.compile_choice)
    final_bytes: int = 0  # host bytes rank 0's node gathers for final/ (check_host_memory)


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


def _recipe_overrides(cfg: dict, source: str, recipe, world_size: int = 1) -> list[str]:
    """Explicit JSON values win over the recipe (only "auto" is filled): legal, but say so."""
    return [f"{source}: {a.key}={json.dumps(value)} overrides the recipe's {a.source}={json.dumps(wanted)}"
            for a, value, wanted in recipe_disagreements(cfg, recipe, world_size) if not a.must_match]


def _optimizer_and_scheduler(raw: dict, resolved: dict, source: str, recipe=None) -> None:
    """The names DeepSpeed resolves, and the scheduler built as the engine will build it."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = resolved.get("optimizer", {}).get("type")
    if "optimizer" in resolved and not (isinstance(name, str) and (
            name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name))):
        raise UserError(f"{source}: optimizer.type: unknown optimizer {json.dumps(name)}; "
                        f"{_hint(str(name), DEEPSPEED_OPTIMIZERS)}")
    if "scheduler" not in resolved:  # memtrain's own schedule from the recipe (memtrain.train.optimizer)
        from memtrain.train.optimizer import schedule_kwargs

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
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("tensorboard", TensorBoardConfig),
                           ("csv_monitor", CSVConfig), ("wandb", WandbConfig), ("comet", CometConfig)):
        if section in resolved:
            try:
                model(**resolved[section])
            except ValidationError as e:
                raise UserError(_pydantic_line(e, source, section, model)) from None
    ds_checks.check_optimizer(resolved, source)
    with ds_log.silenced():  # DeepSpeed's schedulers log warnings while they check
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


# --------------------------------------------------------------------------- cross-file

def check_text(files: list[Path], data: DataSection) -> None:
    """Data files must hold text: catch empty files before any worker tokenizes them."""
    def usable(f: Path) -> bool:
        size = f.stat().st_size
        if size == 0:
            return False
        if builder_for(f) == "text" and size < (1 << 16):
            return bool(f.read_text(errors="replace").strip())
        return True

    if not data.paths:
        return
    if not any(usable(f) for f in files):
        raise UserError(f"data.paths: {', '.join(data.paths)}: the {len(files)} matched file(s) hold no text")


def check_eval_files(data: DataSection, trained: list[Path]) -> None:
    """data.eval_paths: the training files' checks, naming the eval key; a file in both is refused (its documents
    would be trained on, and the eval loss would not be held out)."""
    section = eval_data.eval_section(data)
    try:
        files = resolve_files(section)
        if data.format == "text":
            check_text(files, section)
        check_data_files(files, section)
    except UserError as e:  # the checks name the key they read: data.paths, here data.eval_paths
        raise type(e)(str(e).replace("data.paths", "data.eval_paths", 1)) from None
    both = sorted({f.resolve() for f in files} & {f.resolve() for f in trained})
    if both:
        raise UserError(f"data.eval_paths: {both[0]} is in data.paths too ({len(both)} file(s) in both): held-out "
                        "data must not be trained on")


def check_plan_applies(model, plan: ACPlan) -> None:
    """Install the AC plan on the meta-device model, as the workers will: module patterns that match
    nothing, sublayers a family lacks and layer-count mismatches are found here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # stateful-module warnings: the workers give them
        apply_plan(model, plan)


def check_run_dir(args: RunArgs, world_size: int) -> Optional[checkpoint.ResumePoint]:
    """--run-dir/--resume/--overwrite rules; with --resume, the intact checkpoint to resume from."""
    run_dir = args.run_dir
    if args.resume and args.overwrite:
        raise UserError("--overwrite: cannot be combined with --resume (resume continues a run, overwrite deletes it)")
    run_dirs.check_creatable(run_dir or Path("runs"), "--run-dir")
    if run_dir is not None:
        run_dirs.check_not_in_use(run_dir)
    if args.resume:
        return check_resume(run_dir, world_size, args.recipe.train.max_steps, args.recipe, args.ds_config)
    if run_dir and not args.overwrite and run_dirs.holds_run(run_dir):
        raise UserError(f"--run-dir {run_dir}: already holds a run; pass --resume to continue it "
                        "or --overwrite to replace it")
    return None


def run_device() -> str:
    """The accelerator the workers will train on, as the planner names it."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _trainable_line(model, recipe) -> str:
    """The patterns against the model's parameter names (one line for one that matches nothing), and the plan line."""
    train, lora = recipe.train, recipe.model.lora
    if not (train.trainable or train.frozen or lora):
        return ""
    trainable = count_trainable(model, trainable_patterns(model, lora, train.trainable), train.frozen)
    if lora:  # what trains beside the adapters fits in final/adapter (peft's modules_to_save), or one line now
        saved_with_adapters(model, lora, train.trainable, train.frozen)
    total = sum(p.numel() for p in model.parameters())
    adapters = [f"LoRA r={lora.r} alpha={lora.alpha:g} on {lora.target_modules if isinstance(lora.target_modules, str) else ', '.join(lora.target_modules)}"] if lora else []
    which = "; ".join(adapters + [f"{key} {', '.join(v)}" for key, v in (("train.trainable", train.trainable),
                                                                         ("train.frozen", train.frozen)) if v])
    return (f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%) ({which}); "
            "the rest frozen: no gradient, no optimizer state")


def _byte_tokenizer_warning(recipe, tokenizer, config) -> list[str]:
    """memtrain's byte tokenizer with a pretrained model whose vocabulary is not byte-sized: legal (a test of the
    pipeline), but the model then trains on ids that meant other tokens to it."""
    if tokenizer.name != "byte" or config.vocab_size == tokenizer.vocab_size:
        return []
    own = pretrained_tokenizer(recipe.model.pretrained)
    fix = (f"leave data.tokenizer unset to use the tokenizer in {own}" if own else
           f"{recipe.model.pretrained} holds no tokenizer: set data.tokenizer to the model's tokenizer directory")
    return [f"data.tokenizer: byte (ids 0..256) with model.pretrained's vocabulary of {config.vocab_size}: the "
            f"model trains on byte ids, not the tokens it was pretrained on; {fix}"]


def groups_across_nodes(tp: int, sp: int, world_size: int, source: str) -> list[str]:
    """A tensor- or sequence-parallel group of consecutive ranks that spans nodes (its size above the ranks per node, or
    not dividing them) puts every layer's all-reduces or all-to-alls on the inter-node fabric: a warning line."""
    import os

    per_node = agent_ranks(world_size)  # a worker knows its agent's; make train: all
    found = []
    for key, size, what in ((f"{source}: tensor_parallel.autotp_size", tp, "all-reduces"),
                            ("parallel.sequence", sp, "all-to-alls")):
        if size > 1 and per_node % size:
            found.append(f"{key} {size}: its groups of {size} consecutive ranks span nodes ({per_node} rank(s) per "
                         f"node), so each layer's {what} cross the inter-node network; use a size that divides the "
                         "ranks per node")
    return found


def final_bytes(model, ds_config: dict, train) -> int:
    """Host bytes rank 0 gathers at the end of a run for final/: the whole model in the compute dtype (DeepSpeed's
    16-bit consolidation), on the node that holds global rank 0 only (its agent's first rank is rank 0)."""
    import os

    import torch

    if not train.save_checkpoints or not holds_rank0():
        return 0
    itemsize = torch.empty((), dtype=getattr(torch, compute_dtype(ds_config, run_device()))).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize


def check_host_memory(prediction, world_size: int, ranks_on_node: Optional[int] = None, final: int = 0) -> None:
    """The node's ranks each hold their offloaded activations and model states (pinned pools, host Adam states)
    in host memory; on a CPU run their whole peak is host memory; rank 0's node also holds final/'s gathered model
    at the end (`final`). Against what this node can still allocate (MemAvailable, the cgroup's room: a Slurm job's
    --mem), before any worker starts: one line. `ranks_on_node`: counted across the node's launcher agents once the
    ranks have met (the trainer); before, this agent's ranks."""
    import os
    import socket

    from memtrain.memory.host import available_bytes

    # a worker knows its agent's ranks; make train: all
    ranks = ranks_on_node or agent_ranks(world_size)
    states = prediction.model_states
    per_rank = prediction.host_activations + states.host
    if run_device() == "cpu":
        per_rank += prediction.peak
    available = available_bytes()
    if ranks * per_rank + final > available:
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        raise NodeError(f"host memory: {ranks} rank(s) on this node x {g(per_rank)} each (offloaded activations "
                        f"{g(prediction.host_activations)} + offloaded model states {g(states.host)}"
                        + (f" + the CPU run's peak {g(prediction.peak)}" if run_device() == "cpu" else "")
                        + (f") + final/'s model gathered on rank 0 {g(final)}" if final else ")")
                        + f" = {g(ranks * per_rank + final)} predicted, {g(available)} available on "
                        f"{socket.gethostname()}; "
                        "offload less (cpu_checkpointing, offload_optimizer), lower train.micro_batch_size, or run "
                        "fewer ranks per node")


def check_run(args: RunArgs, world_size: int) -> Checked:
    """Every check, cheapest first; raises UserError on the first mistake."""
    recipe, source = args.recipe, args.ds_config_path
    warnings = check_ds_json(args.ds_config, source)
    check_batch(args.ds_config, source, recipe, world_size)
    resume = check_run_dir(args, world_size)
    if resume is not None:
        warnings += resume.warnings(args.run_dir / "checkpoints")
    recipe_source = args.recipe_path or "embedded recipe 'tiny'"
    try:  # these name a recipe key path; say which recipe too
        check_seq_len(recipe.data)
        files = [] if recipe.data.random_tokens else resolve_files(recipe.data)
        if files and recipe.data.format == "text":
            check_text(files, recipe.data)
        if files:
            check_data_files(files, recipe.data)
        if files:
            run_dirs.check_creatable(Path(recipe.data.cache_dir), "data.cache_dir")
        eval_data.check_settings(recipe.data, recipe.train)
        if eval_data.has_eval_data(recipe.data):
            check_eval_files(recipe.data, files)
        tokenizer = build_tokenizer(recipe.data.tokenizer)
        if files and recipe.data.format != "text":  # columns and rows: when packing (memtrain.model.chat_data)
            check_template(tokenizer, recipe.data)
            if recipe.parallel.sequence > 1:
                raise UserError(f"data.format: '{recipe.data.format}' packs samples with positions restarting per "
                                "sample, which Ulysses sequence parallelism (parallel.sequence > 1) does not keep "
                                "apart across its slices; use data.format text or parallel.sequence 1")
        config = build_config(recipe.model, tokenizer.vocab_size, recipe.data.seq_len)
        model = build_on_meta(recipe.model, config)  # transformers' own checks of the config values
        if recipe.model.pretrained:  # its weight files whole, of the shapes this model has (no tensor read)
            check_pretrained(recipe.model, model)
            warnings += _byte_tokenizer_warning(recipe, tokenizer, config)
        if recipe.model.lora is not None:  # the adapted model: its names, layers and what trains
            add_lora(model, recipe.model.lora)
        trained = _trainable_line(model, recipe)
        section = recipe.activation_checkpointing
        # ZeRO-3's layout first: where its hooks stay inside a recomputed unit, the spec's backend differs
        zero3 = zero3_layout(args.ds_config, type(decoder_layers(model)[1][0]),
                             max(p.numel() for p in model.parameters()), world_size // tp_size(args.ds_config),
                             segments=section.policy.partition("+")[0] == "sqrt")
        spec = resolve_recompute(args.ds_config, section, run_device(), tp_size(args.ds_config),
                                 zero3_hooks_inside=zero_stage(args.ds_config) == 3 and not zero3.leaf_layers)
        memory_plan = None
        if spec.policy == "auto":  # per-layer plan that fits activation_checkpointing.memory_budget
            from memtrain.memory.planner import auto_plan

            plan, memory_plan = auto_plan(spec, recipe, args.ds_config, world_size, config)
        else:
            plan = build_plan(spec, config.num_hidden_layers)
        check_plan_applies(model, plan)
        long_context.check(recipe, args.ds_config, config, world_size)
        layer_class = type(decoder_layers(model)[1][0])
        hooks_inside = zero_stage(args.ds_config) == 3 and not zero3.leaf_layers and \
            not leaf_names_layer(args.ds_config, layer_class)
        compiled = choose_compile(recipe.train.compile, plan, run_device(), tp_size(args.ds_config),
                                  recipe.parallel.sequence, hooks_inside,
                                  sharded=zero_stage(args.ds_config) == 3 and not zero3.persistence_threshold)
    except UserError as e:
        raise type(e)(f"{recipe_source}: {e}") from None  # a NodeError stays one
    check_tensor_parallel(args.ds_config, source, config, world_size)
    if tp_size(args.ds_config) > 1 and recipe.model.lora is not None:
        raise UserError(f"{source}: tensor_parallel.autotp_size: cannot be combined with the recipe's model.lora: "
                        "AutoTP shards torch Linear layers, and peft's LoRA layers wrap them (untested together)")
    if zero_stage(args.ds_config) == 3 and recipe.model.lora is not None and recipe.model.lora.use_dora:
        raise UserError(f"{source}: zero_optimization.stage: 3 cannot train the recipe's model.lora.use_dora: DoRA reads "
                        "each adapted layer's whole base weight outside that layer's forward (its weight norm), where "
                        "ZeRO-3 holds only this rank's partition (peft fails on 2 ranks); use stage 0-2 or use_dora false")
    if tp_size(args.ds_config) > 1 and recipe.parallel.sequence > 1:
        raise UserError(f"{source}: tensor_parallel.autotp_size: cannot be combined with the recipe's parallel.sequence "
                        f"({recipe.parallel.sequence}); memtrain runs AutoTP or Ulysses sequence parallelism, not both")
    check_autotp_model(args.ds_config, source, model)
    rng.check(config, model, tp_size(args.ds_config), source)  # dropout masks AutoTP's shards can take
    if resume is not None and is_rank_zero():  # rank 0 decides the checkpoint every rank loads (checkpoint.load)
        check_shapes(args.run_dir / "checkpoints" / resume.tag, model,
                     packed_shapes(model) if recipe.model.quantization is not None else None)
    hidden = model_hidden_size(config)
    needs_model = [a.key for a in AUTO_KEYS if a.needs_model and get(args.ds_config, a.key) == AUTO]
    if needs_model and hidden is None:
        raise UserError(f"{source}: {needs_model[0]}: \"auto\" is sized by the model's hidden_size, which its "
                        "config does not have; write a number")
    resolved = zero3.apply(resolve_ds_config(args.ds_config, recipe, 1, Path("runs/validate"), plan.checkpoint_calls,
                                             hidden_size=hidden))
    deepspeed_accepts(args.ds_config, resolved, source, recipe)
    check_quantized_base(resolved, recipe, source, compiled.on)  # QLoRA: what a 4-bit base cannot run with
    plan = with_expected_bytes(plan, config, recipe, resolved)
    prediction = memory_plan.prediction if memory_plan is not None else predict_run(
        recipe, args.ds_config, world_size, plan, config)
    if compiled.on:  # never an eager prediction passed off as a compiled run's
        prediction = replace(prediction, notes=prediction.notes + (EAGER_PREDICTION,))
    gathered = final_bytes(model, args.ds_config, recipe.train)
    check_host_memory(prediction, world_size, final=gathered)
    warnings += _recipe_overrides(args.ds_config, source, recipe, world_size)
    warnings += groups_across_nodes(tp_size(args.ds_config), recipe.parallel.sequence, world_size, source)
    warnings += [w for w in (ds_checks.build_notice(resolved),) if w]
    warnings += ds_checks.clear_stale_build_locks()
    warnings += [f"{source}: activation_checkpointing.{key}: true is ignored by the torch backend (DeepSpeed's "
                 "checkpoint honours it: set activation_checkpointing.backend: deepspeed in the recipe)"
                 for key in spec.ignored_by_torch]
    if trained and not recipe.model.pretrained:
        which = "model.lora" if recipe.model.lora else "train.trainable" if recipe.train.trainable else "train.frozen"
        warnings.append(f"{which}: the base model is randomly initialised (no model.pretrained), so the weights that "
                        "train adapt noise: this fine-tunes nothing; set model.pretrained to a local transformers "
                        "directory (fine for testing the pipeline)")
    if memory_plan is None and recipe.activation_checkpointing.memory_budget is not None:
        warnings.append(f"activation_checkpointing.memory_budget is ignored by policy '{plan.policy}' (used by 'auto')")
    experts = experts_line(config, compute_dtype(args.ds_config, run_device()))
    model_lines = tuple(line for line in (trained, experts) if line)
    return Checked(files, tokenizer, config, plan, tuple(warnings), memory_plan, zero3, spec, model_lines, prediction,
                   compiled, gathered)


# --------------------------------------------------------------------------- CLI

@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    """`python -m memtrain.train.preflight [--world-size N] <train.py args>`: check, and pack the data.

    Silent with exit 0 when everything is fine; the packed corpus is cached for the workers.
    """
    from memtrain.model.data import prepare_data

    args = parse_args(sys.argv[1:] if argv is None else argv, preflight_parser())
    check_run(args, args.world_size)
    if args.resume:  # a checkpoint of another world size: converted here, once (memtrain.train.reshard)
        reshard.prepare(args.run_dir / "checkpoints", args.world_size)
    recipe = args.recipe
    if not recipe.data.random_tokens:
        prepare_data(recipe.data, recipe.train.seed)
    held_out = eval_data.prepare_eval_data(recipe.data, recipe.train.seed)
    if held_out is not None:  # enough eval rows for one batch on every data rank
        dp_size = args.world_size // (tp_size(args.ds_config) * recipe.parallel.sequence)
        eval_data.batches_per_rank(len(held_out), recipe.train.eval_batches, dp_size, recipe.train.micro_batch_size,
                                   recipe.train.grad_accum_steps)


if __name__ == "__main__":
    main()

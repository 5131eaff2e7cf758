"""The run resolved once, before any worker starts: every check, and the decisions the run takes from them.

`resolve_run` is one code path for every entry point: named steps, cheapest first, returning one frozen
`RunSetup` (files, tokenizer, model config, RecomputeSpec and ZeRO-3 layout, the AC plan and the auto plan,
the prediction, the compile choice). The trainer calls it in each worker before distributed init;
`python -m memtrain.train.preflight --world-size N <train.py args>` runs it in a plain process before a
launcher starts (`make train` does), so a mistake is exactly one stderr line (exit 2) and no worker starts.
The recipe schema lives in `memtrain.config.recipe`, the DeepSpeed JSON's own checks in
`memtrain.config.ds_validate`; here is everything that spans files.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional
import socket

import torch

from memtrain.train import checkpoint, long_context, reshard
from memtrain.train import run_dir as run_dirs
from memtrain.train.node import agent_ranks, holds_rank0
from memtrain.train.resume_check import check_resume, check_shapes
from memtrain.model.data_check import check_data_files, check_seq_len
from memtrain.recompute.policy import ACPlan, build_plan
from memtrain.config.recompute_spec import RecomputeSpec
from memtrain.model.freeze import count_trainable, saved_with_adapters
from memtrain.model.chat_data import check_template
from memtrain.model.lora import add_lora, trainable_patterns
from memtrain.model.moe import experts_line
from memtrain.model.pretrained import check_pretrained
from memtrain.memory.target import compute_dtype, resolve_spec
from memtrain.memory.planner import auto_plan, predict_run
from memtrain.memory import profile_cache
from memtrain.units import GIB
from memtrain.config.args import RunArgs, parse_args, preflight_parser
from memtrain.model.data import build_tokenizer, builder_for, prepare_data, resolve_files
from memtrain.model import eval_data
from memtrain.config.ds_config import AUTO, AUTO_KEYS, get, model_hidden_size, resolve_ds_config, zero_stage
from memtrain.config import ds_checks
from memtrain.config.ds_validate import check_json, check_tensor_parallel, deepspeed_accepts, recipe_overrides
from memtrain.train import rng
from memtrain.train.compile_choice import COMPILED_PREDICTION, EAGER_AUTO_PLAN, CompileChoice, choose_compile
from memtrain.train.qlora_checks import check_quantized_base
from memtrain.model import packed_attention
from memtrain.model.quantize import packed_shapes
from memtrain.errors import NodeError, UserError, cli_entry, is_rank_zero
from memtrain.model.build import build_config, build_on_meta, decoder_layers
from memtrain.config.zero3 import Zero3Layout, hooks_inside_layers
from memtrain.recompute.units import model_units
from memtrain.config.recipe import DataSection, pretrained_tokenizer
from memtrain.recompute.partition import with_expected_bytes
from memtrain.train.parallel import check_autotp_model
from memtrain.config.ds_config import tp_size
from memtrain.memory.host import available_bytes


@dataclass(frozen=True)
class RunSetup:
    """The run as `resolve_run` decided it; the trainer, explain-config and the tools read it, none decides again."""

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
    targets = lora and (lora.target_modules if isinstance(lora.target_modules, str) else ', '.join(lora.target_modules))
    adapters = [f"LoRA r={lora.r} alpha={lora.alpha:g} on {targets}"] if lora else []
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


@contextmanager
def _naming_recipe(args: RunArgs):
    """The steps inside name a recipe key path: say which recipe too (a NodeError stays one)."""
    try:
        yield
    except UserError as e:
        raise type(e)(f"{args.recipe_path or 'embedded recipe ' + repr('tiny')}: {e}") from None


def _data_inputs(recipe) -> tuple[list[Path], Any]:
    """The data files and the tokenizer, each checked."""
    data = recipe.data
    check_seq_len(data)
    files = [] if data.random_tokens else resolve_files(data)
    if files:
        if data.format == "text":
            check_text(files, data)
        check_data_files(files, data)
        run_dirs.check_creatable(Path(data.cache_dir), "data.cache_dir")
    eval_data.check_settings(data, recipe.train)
    if eval_data.has_eval_data(data):
        check_eval_files(data, files)
    tokenizer = build_tokenizer(data.tokenizer)
    if files and data.format != "text":  # columns and rows: when packing (memtrain.model.chat_data)
        check_template(tokenizer, data)
        if recipe.parallel.sequence > 1:
            raise UserError(f"data.format: '{data.format}' packs samples with positions restarting per "
                            "sample, which Ulysses sequence parallelism (parallel.sequence > 1) does not keep "
                            "apart across its slices; use data.format text or parallel.sequence 1")
    return files, tokenizer


def _meta_model(recipe, tokenizer) -> tuple[Any, Any, list[str]]:
    """The transformers config, the model on the meta device as the workers build it (adapters added; transformers'
    own checks of the config values run), and warnings about it."""
    config = build_config(recipe.model, tokenizer.vocab_size, recipe.data.seq_len)
    model = build_on_meta(recipe.model, config)
    warnings = []
    if recipe.model.pretrained:  # its weight files whole, of the shapes this model has (no tensor read)
        check_pretrained(recipe.model, model)
        warnings += _byte_tokenizer_warning(recipe, tokenizer, config)
    if recipe.model.lora is not None:  # the adapted model: its names, layers and what trains
        add_lora(model, recipe.model.lora)
    return config, model, warnings


def _ac_plan(spec: RecomputeSpec, args: RunArgs, world_size: int, config, model) -> tuple[ACPlan, Any]:
    """The per-layer plan of the spec (policy auto: the planner's, under memory_budget, and its PlanResult), checked
    against the model's modules."""
    memory_plan = None
    if spec.policy == "auto":
        plan, memory_plan = auto_plan(spec, args.recipe, args.ds_config, world_size, config)
    else:
        plan = build_plan(spec, config.num_hidden_layers)
    # the units the workers will install, listed on the meta model (nothing installed): module patterns that match
    # nothing, sublayers a family lacks and layer-count mismatches are found here
    model_units(model, plan)
    return plan, memory_plan


def _compile_choice(recipe, ds_config: dict, plan: ACPlan, zero3: Zero3Layout, model) -> CompileChoice:
    """train.compile for this plan, device and layout (memtrain.train.compile_choice)."""
    layer_class = type(decoder_layers(model)[1][0])
    return choose_compile(recipe.train.compile, plan, run_device(), tp_size(ds_config), recipe.parallel.sequence,
                          hooks_inside_layers(ds_config, zero3, layer_class),
                          sharded=zero_stage(ds_config) == 3 and not zero3.persistence_threshold)


def _check_layout(args: RunArgs, config, model, world_size: int) -> None:
    """Tensor parallelism against the world, the model and what it cannot be combined with; dropout under AutoTP."""
    recipe, source, tp = args.recipe, args.ds_config_path, tp_size(args.ds_config)
    check_tensor_parallel(args.ds_config, source, config, world_size)
    if tp > 1 and recipe.model.lora is not None:
        raise UserError(f"{source}: tensor_parallel.autotp_size: cannot be combined with the recipe's model.lora: "
                        "AutoTP shards torch Linear layers, and peft's LoRA layers wrap them (untested together)")
    if zero_stage(args.ds_config) == 3 and recipe.model.lora is not None and recipe.model.lora.use_dora:
        raise UserError(f"{source}: zero_optimization.stage: 3 cannot train the recipe's model.lora.use_dora: DoRA reads "
                        "each adapted layer's whole base weight outside that layer's forward (its weight norm), where "
                        "ZeRO-3 holds only this rank's partition (peft fails on 2 ranks); use stage 0-2 or use_dora false")
    if tp > 1 and recipe.parallel.sequence > 1:
        raise UserError(f"{source}: tensor_parallel.autotp_size: cannot be combined with the recipe's parallel.sequence "
                        f"({recipe.parallel.sequence}); memtrain runs AutoTP or Ulysses sequence parallelism, not both")
    check_autotp_model(args.ds_config, source, model)
    rng.check(config, model, tp, source)  # dropout masks AutoTP's shards can take


def _resolved_json(args: RunArgs, config, plan: ACPlan, zero3: Zero3Layout) -> dict:
    """The JSON as the engine gets it (every "auto" filled, as for one rank), accepted by DeepSpeed's own classes."""
    source = args.ds_config_path
    hidden = model_hidden_size(config)
    needs_model = [a.key for a in AUTO_KEYS if a.needs_model and get(args.ds_config, a.key) == AUTO]
    if needs_model and hidden is None:
        raise UserError(f"{source}: {needs_model[0]}: \"auto\" is sized by the model's hidden_size, which its "
                        "config does not have; write a number")
    resolved = zero3.apply(resolve_ds_config(args.ds_config, args.recipe, 1, Path("runs/validate"),
                                             plan.checkpoint_calls, hidden_size=hidden))
    deepspeed_accepts(args.ds_config, resolved, source, args.recipe)
    return resolved


def _prediction(args: RunArgs, world_size: int, plan: ACPlan, config, memory_plan, compiled: CompileChoice):
    """(policy auto's PlanResult, the predicted peak of this plan): the auto plan's own, for policy auto; under
    train.compile, for compiled layers. An auto plan made for eager layers (train.compile auto, decided after the plan)
    is predicted again for compiled ones."""
    planned_compiled = args.recipe.train.compile is True  # what make_target, and so the auto plan, predicted for
    if memory_plan is not None and planned_compiled == compiled.on:
        prediction = memory_plan.prediction
    else:
        prediction = predict_run(args.recipe, args.ds_config, world_size, plan, config, compiled=compiled.on)
    if compiled.on:
        notes = (COMPILED_PREDICTION,) + ((EAGER_AUTO_PLAN,) if memory_plan is not None and not planned_compiled else ())
        prediction = replace(prediction, notes=prediction.notes + notes)
    if memory_plan is not None:
        memory_plan = replace(memory_plan, prediction=prediction)
    return memory_plan, prediction


def _setup_warnings(args: RunArgs, world_size: int, resolved: dict, spec: RecomputeSpec, plan: ACPlan,
                    memory_plan, trained: str) -> list[str]:
    """Legal settings that do less than asked or cost more than they should: one warning line each."""
    recipe, source = args.recipe, args.ds_config_path
    warnings = recipe_overrides(args.ds_config, source, recipe, world_size)
    warnings += groups_across_nodes(tp_size(args.ds_config), recipe.parallel.sequence, world_size, source)
    warnings += [w for w in (ds_checks.build_notice(resolved),) if w]
    if ds_checks.loads_ops(resolved):  # only a launch that loads an op waits on a build lock (torch's FileBaton)
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
    return warnings


def resolve_run(args: RunArgs, world_size: int) -> RunSetup:
    """The run resolved once, cheapest check first; raises UserError (one line) on the first mistake."""
    recipe = args.recipe
    warnings = check_json(args.ds_config, args.ds_config_path, recipe, world_size)
    resume = check_run_dir(args, world_size)
    if resume is not None:
        warnings += resume.warnings(run_dirs.RunDir(args.run_dir).checkpoints)
    profile_cache.keep_in(Path(recipe.data.cache_dir) / "profiles")  # the ranks read what the preflight measured
    with _naming_recipe(args):
        files, tokenizer = _data_inputs(recipe)
        config, model, model_warnings = _meta_model(recipe, tokenizer)
        if files and recipe.data.format != "text":  # chat/instruction rows pack whole samples
            packed_attention.check(config, recipe.data.format)
        trained = _trainable_line(model, recipe)
        spec, zero3 = resolve_spec(recipe, args.ds_config, world_size, run_device(), model)
        plan, memory_plan = _ac_plan(spec, args, world_size, config, model)
        long_context.check(recipe, args.ds_config, config, world_size)
        compiled = _compile_choice(recipe, args.ds_config, plan, zero3, model)
    _check_layout(args, config, model, world_size)
    if resume is not None and is_rank_zero():  # rank 0 decides the checkpoint every rank loads (checkpoint.load)
        check_shapes(run_dirs.RunDir(args.run_dir).checkpoints / resume.tag, model,
                     packed_shapes(model) if recipe.model.quantization is not None else None)
    resolved = _resolved_json(args, config, plan, zero3)
    check_quantized_base(resolved, recipe, args.ds_config_path, compiled.on)  # QLoRA: what a 4-bit base cannot run with
    plan = with_expected_bytes(plan, config, recipe, resolved)
    memory_plan, prediction = _prediction(args, world_size, plan, config, memory_plan, compiled)
    gathered = final_bytes(model, args.ds_config, recipe.train)
    check_host_memory(prediction, world_size, final=gathered)
    warnings += model_warnings + _setup_warnings(args, world_size, resolved, spec, plan, memory_plan, trained)
    experts = experts_line(config, compute_dtype(args.ds_config, run_device()))
    return RunSetup(files, tokenizer, config, plan, tuple(warnings), memory_plan, zero3, spec,
                    tuple(line for line in (trained, experts) if line), prediction, compiled, gathered)


# --------------------------------------------------------------------------- CLI

@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    """`python -m memtrain.train.preflight [--world-size N] <train.py args>`: check, and pack the data.

    Silent with exit 0 when everything is fine; the packed corpus is cached for the workers.
    """
    args = parse_args(sys.argv[1:] if argv is None else argv, preflight_parser())
    resolve_run(args, args.world_size)
    if args.resume:  # a checkpoint of another world size: converted here, once (memtrain.train.reshard)
        reshard.prepare(run_dirs.RunDir(args.run_dir).checkpoints, args.world_size)
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

"""`python -m memtrain export RUN_DIR [--step N] [--out DIR]`: a saved model checkpoint as a transformers directory.

DeepSpeed's own zero_to_fp32 consolidation of the shards (any stage, one CPU process), in fp32, written
as `final/` is at the end of a run (memtrain.train.final): `AutoModelForCausalLM.from_pretrained(dir)`
loads it, with the adapters merged and beside it in `adapter/` for a LoRA run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional
import contextlib
import io

from memtrain.errors import ArgumentParser, UserError, cli_entry
from memtrain.train.run_dir import RunDir


def export(run_dir: Path, step: Optional[int] = None, out: Optional[Path] = None) -> Path:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415 deepspeed: heavy, kept off --help

    from memtrain.config.recipe import Recipe  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.model.build import build_config, build_model  # noqa: PLC0415 pulls pydantic, torch: heavy, kept off --help
    from memtrain.model.data import build_tokenizer  # noqa: PLC0415 pulls numpy, pydantic, torch: heavy, kept off --help
    from memtrain.train import checkpoint  # noqa: PLC0415 pulls numpy, torch: heavy, kept off --help
    from memtrain.train.final import write_model  # noqa: PLC0415 pulls numpy, pydantic, torch: heavy, kept off --help

    config_path = RunDir(run_dir).config_file
    if not config_path.is_file():
        raise UserError(f"{run_dir}: not a memtrain run directory (no config.json)")
    try:
        recipe = Recipe.model_validate(json.loads(config_path.read_text(encoding="utf-8"))["recipe"])
    except (ValueError, KeyError, TypeError) as e:  # cut, not JSON, or not a run's record (pydantic's is a ValueError)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{config_path}: damaged ({type(e).__name__}: {first}): the recipe the run trained with is "
                        "unknown, so its model cannot be rebuilt; restore config.json from a copy") from None
    if recipe.model.quantization is not None:
        raise UserError(f"{run_dir}: export of a QLoRA run (model.quantization) is not supported: its checkpoints hold "
                        "the 4-bit base without bitsandbytes' quant state; use the run's final/ (written at its end)")
    checkpoint_dir = RunDir(run_dir).checkpoints
    tags = sorted(p.name for p in checkpoint_dir.glob(f"{checkpoint.TAG_PREFIX}*") if p.is_dir())
    if not tags:
        raise UserError(f"{checkpoint_dir}: no model checkpoint to export")
    tag = checkpoint.tag_for(step) if step is not None else tags[-1]
    if tag not in tags:
        raise UserError(f"--step {step}: no model checkpoint {tag} in {checkpoint_dir}; saved: {', '.join(tags)}")
    out = out or run_dir / f"export-{tag}"
    tokenizer = build_tokenizer(recipe.data.tokenizer)
    config = build_config(recipe.model, tokenizer.vocab_size, recipe.data.seq_len)

    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    try:
        write_model(lambda: build_model(recipe.model, config), recipe, state, out, _saved_with_adapters(recipe, config))
    except ValueError as e:
        raise UserError(f"{checkpoint_dir / tag}: {e}") from None
    return out


def _saved_with_adapters(recipe, config) -> tuple[str, ...]:
    """With LoRA, the modules that trained whole beside the adapters (named on the meta model: nothing allocated)."""
    if recipe.model.lora is None:
        return ()
    from memtrain.model.build import build_on_meta  # noqa: PLC0415 pulls pydantic, torch: heavy, kept off --help
    from memtrain.model.freeze import saved_with_adapters  # noqa: PLC0415 pulls pydantic, torch: heavy, kept off --help
    from memtrain.model.lora import add_lora  # noqa: PLC0415 pulls pydantic, torch: heavy, kept off --help

    model = build_on_meta(recipe.model, config)
    add_lora(model, recipe.model.lora)
    return saved_with_adapters(model, recipe.model.lora, recipe.train.trainable, recipe.train.frozen)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, help="the model checkpoint of this step (default: the newest)")
    p.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/export-stepNNNNNNNN)")
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    print(export(args.run_dir, args.step, args.out))

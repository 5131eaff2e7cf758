"""A trained model as a transformers directory: `final/` at the end of a run, and
`python -m memtrain export RUN_DIR [--step N] [--out DIR]` for any saved model checkpoint.

Written with `save_pretrained` (safetensors) plus the tokenizer, so that
`AutoModelForCausalLM.from_pretrained(dir)` loads it; no DeepSpeed needed to read it.
- end of a run (`save_final`): DeepSpeed gathers the ZeRO-3 partitions layer by layer to rank 0,
  which writes the weights in the engine's compute dtype (16-bit under bf16/fp16).
- from a checkpoint (`export`): DeepSpeed's own zero_to_fp32 consolidation of the shards (any stage,
  one CPU process), in fp32.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from memtrain.errors import UserError, cli_entry


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what tokenizers' ByteLevel pre-tokenizer uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_tokenizer(spec: str, out: Path) -> None:
    """The run's tokenizer: a local HF tokenizer is copied; memtrain's 'byte' tokenizer (ids 0..255 =
    UTF-8 bytes, 256 = EOS) is written as an equivalent byte-level fast tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec != "byte":
        AutoTokenizer.from_pretrained(spec, local_files_only=True).save_pretrained(out)
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)


def save_final(engine, model, out: Path, tokenizer_spec: str) -> None:
    """End of a run, on every rank: rank 0 writes `out`. Under ZeRO-3 or AutoTP DeepSpeed's own
    consolidation gathers one layer at a time, ZeRO partitions and tensor-parallel shards alike, to rank
    0's host memory (as `save_16bit_model` and accelerate do)."""
    import deepspeed.comm as dist

    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state = engine._consolidated_16bit_state_dict()  # every rank takes part; None off rank 0
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a clean run's console: plan, bar, summary
        try:
            model.save_pretrained(out, state_dict=state, safe_serialization=True)
        finally:
            hf_logging.enable_progress_bar()
        save_tokenizer(tokenizer_spec, out)
    dist.barrier()


def export(run_dir: Path, step: Optional[int] = None, out: Optional[Path] = None) -> Path:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from memtrain.config.recipe import Recipe
    from memtrain.model.build import build_config, build_model
    from memtrain.model.data import build_tokenizer
    from memtrain.train import checkpoint

    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{run_dir}: not a memtrain run directory (no config.json)")
    recipe = Recipe.model_validate(json.loads(config_path.read_text())["recipe"])
    checkpoint_dir = run_dir / "checkpoints"
    tags = sorted(p.name for p in checkpoint_dir.glob(f"{checkpoint.TAG_PREFIX}*") if p.is_dir())
    if not tags:
        raise UserError(f"{checkpoint_dir}: no model checkpoint to export")
    tag = checkpoint.tag_for(step) if step is not None else tags[-1]
    if tag not in tags:
        raise UserError(f"--step {step}: no model checkpoint {tag} in {checkpoint_dir}; saved: {', '.join(tags)}")
    out = out or run_dir / f"export-{tag}"
    tokenizer = build_tokenizer(recipe.data.tokenizer)
    model = build_model(recipe.model, build_config(recipe.model, tokenizer.vocab_size, recipe.data.seq_len))
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", None) or []]
    if unexpected:
        raise UserError(f"{checkpoint_dir / tag}: holds weights the recipe's model does not have: {unexpected[:3]}")
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(recipe.data.tokenizer, out)
    return out


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="memtrain export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, help="the model checkpoint of this step (default: the newest)")
    p.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/export-stepNNNNNNNN)")
    args = p.parse_args(argv)
    print(export(args.run_dir, args.step, args.out))

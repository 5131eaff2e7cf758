"""`final/` at the end of a run: the trained model as a transformers directory, with its tokenizer.

Written with `save_pretrained` (safetensors), so that `AutoModelForCausalLM.from_pretrained(final)` loads
it with no DeepSpeed. Under ZeRO-3 or AutoTP DeepSpeed's own consolidation gathers one layer at a time,
ZeRO partitions and tensor-parallel shards alike, to rank 0's host memory (as `save_16bit_model` and
accelerate do), in the engine's compute dtype. A LoRA run (memtrain.model.lora) writes the merged model
and, in `final/adapter/`, the adapters alone. `python -m memtrain export` writes the same from a saved
model checkpoint (memtrain.tools.export).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from memtrain.model.data import save_tokenizer


def write_model(model_factory: Callable, recipe, state: dict, out: Path) -> None:
    """`out` from a full state dict of the trained model (its own parameter names); `model_factory()` builds the
    recipe's model on the CPU. ValueError when the state does not fit the recipe's model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a clean run's console: plan, bar, summary
    try:
        if recipe.model.lora is not None:
            from memtrain.model.lora import save_merged

            save_merged(model_factory, recipe.model.lora, state, out)
        else:
            model = model_factory()
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"holds weights the recipe's model does not have: {unexpected[:3]}")
            model.save_pretrained(out, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    save_tokenizer(recipe.data.tokenizer, out)


def save_final(engine, model, out: Path, recipe, model_factory: Callable) -> None:
    """End of a run, on every rank: rank 0 writes `out`."""
    import deepspeed.comm as dist

    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state = engine._consolidated_16bit_state_dict()  # every rank takes part; None off rank 0
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        if recipe.model.lora is None:  # the trained module itself writes its config and weights
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            try:
                model.save_pretrained(out, state_dict=state, safe_serialization=True)
            finally:
                hf_logging.enable_progress_bar()
            save_tokenizer(recipe.data.tokenizer, out)
        else:
            write_model(model_factory, recipe, state, out)
    dist.barrier()

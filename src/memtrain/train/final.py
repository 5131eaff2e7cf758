"""`final/` at the end of a run: the trained model as a transformers directory, with its tokenizer.

In transformers' layout (safetensors), so that `AutoModelForCausalLM.from_pretrained(final)` loads it with no
DeepSpeed. The weights are gathered one module at a time, ZeRO partitions and tensor-parallel shards alike, in the
engine's compute dtype, and rank 0 writes them shard by shard as they arrive (memtrain.train.final_weights).
A LoRA run (memtrain.model.lora) writes the merged model
and, in `final/adapter/`, the adapters alone. `python -m memtrain export` writes the same from a saved
model checkpoint (memtrain.tools.export).

`final/` is written to be served: its config has `use_cache: true` (generation reuses the KV cache; training
turned it off), and for chat or instruction data `generation_config.json` stops at the chat template's
end-of-turn token as well as at the tokenizer's end of sequence; `data.chat_template` is the tokenizer's template.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable
import json

import deepspeed.comm as dist

from memtrain.model.data import save_tokenizer
from memtrain.model.chat_data import end_of_turn_id, template_text
from memtrain.model.freeze import saved_with_adapters
from memtrain.model.lora import save_merged
from memtrain.model.quantize import dequantized_state
from memtrain.train.final_weights import stream_weights, write_config


def write_model(model_factory: Callable, recipe, state: dict, out: Path, saved: tuple[str, ...] = ()) -> None:
    """`out` from a full state dict of the trained model (its own parameter names); `model_factory()` builds the
    recipe's model on the CPU; `saved`: with LoRA, the modules that trained whole, which final/adapter keeps
    (memtrain.model.freeze.saved_with_adapters). ValueError when the state does not fit the recipe's model."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 transformers: heavy, imported only when this runs

    hf_logging.disable_progress_bar()  # a clean run's console: plan, bar, summary
    try:
        if recipe.model.lora is not None:
            save_merged(model_factory, recipe.model.lora, state, out, saved)
        else:
            model = model_factory()
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"holds weights the recipe's model does not have: {unexpected[:3]}")
            model.save_pretrained(out, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    save_tokenizer(recipe.data.tokenizer, out)
    make_servable(out, recipe.data)


def make_servable(out: Path, data) -> None:
    """`out`'s config with the KV cache on; for chat/instruction data the recipe's chat template in its tokenizer and
    the template's end-of-turn token among generation's end-of-sequence ids."""
    config_file = out / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["use_cache"] = True
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if data.format == "text" or data.tokenizer in ("byte", None):
        return
    from transformers import AutoTokenizer, GenerationConfig  # noqa: PLC0415 transformers: heavy, imported only when this runs

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if data.chat_template:
        tok.chat_template = template_text(data)
        tok.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(out)
    except OSError:  # no generation_config.json
        generation = GenerationConfig()
    eos = generation.eos_token_id
    special = set(tok.all_special_ids)  # the model config's own ids only where they are this tokenizer's specials
    kept = [i for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]) if i in special]
    generation.eos_token_id = list(dict.fromkeys(i for i in (tok.eos_token_id, end_of_turn_id(tok), *kept)
                                                 if i is not None))
    generation.use_cache = True
    generation.save_pretrained(out)


def save_final(engine, model, out: Path, recipe, model_factory: Callable) -> None:
    """End of a run, on every rank: rank 0 writes `out`. The weights stream to disk as they are gathered
    (memtrain.train.final_weights: one shard in host memory, no rank waiting past the collective timeout); a LoRA
    run's merge needs the whole state dict, gathered by DeepSpeed's consolidation to rank 0's host memory first."""
    if recipe.model.lora is None:
        from transformers.utils import logging as hf_logging  # noqa: PLC0415 transformers: heavy, imported only when this runs

        stream_weights(model, out, recipe.train.collective_timeout_s, engine.device)
        if dist.get_rank() == 0:
            hf_logging.disable_progress_bar()
            try:
                write_config(model, out)
            finally:
                hf_logging.enable_progress_bar()
            save_tokenizer(recipe.data.tokenizer, out)
            make_servable(out, recipe.data)
        dist.barrier()
        return
    if engine.zero_optimization_partition_weights() or engine.autotp_size() > 1:
        state = engine._consolidated_16bit_state_dict()  # every rank takes part; None off rank 0
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        if recipe.model.quantization is not None:  # the base as it trained: each 4-bit weight dequantized

            state = dequantized_state(model, state)
        write_model(model_factory, recipe, state, out, saved_with_adapters(
            model, recipe.model.lora, recipe.train.trainable, recipe.train.frozen))
    dist.barrier()

"""Build a transformers causal LM from a recipe: from config, or from a local directory."""
from __future__ import annotations

import difflib
from pathlib import Path

import torch
from torch import nn

from .errors import UserError
from .recipe import ModelSection

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_config(section: ModelSection, vocab_size: int, seq_len: int):
    """A transformers config for the recipe, checked for the mistakes users make most."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if section.pretrained:
        if not (Path(section.pretrained) / "config.json").is_file():
            raise UserError(f"model.pretrained: '{section.pretrained}' has no config.json")
        config = AutoConfig.from_pretrained(section.pretrained, local_files_only=True, **section.config)
    else:
        if section.type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(section.type, list(CONFIG_MAPPING.keys()), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"model.type: unknown transformers model type '{section.type}'{hint}")
        known = _config_keys(CONFIG_MAPPING[section.type]())
        for key in section.config:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise UserError(f"model.config.{key}: not a {section.type} config key{hint}")
        kwargs = {"vocab_size": vocab_size, **section.config}
        try:
            config = AutoConfig.for_model(section.type, **kwargs)
        except (ValueError, TypeError) as e:
            raise UserError(f"model.config: {str(e).splitlines()[0]}") from None
    _check_shapes(config, vocab_size, seq_len)
    config.use_cache = False  # training never reads the KV cache
    return config


def _config_keys(config) -> set[str]:
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}))


def _check_shapes(config, vocab_size: int, seq_len: int) -> None:
    hidden, heads = config.hidden_size, config.num_attention_heads
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        value = getattr(config, name, None)
        if value is not None and value <= 0:
            raise UserError(f"model.config.{name}: must be positive (got {value})")
    if hidden % heads:
        raise UserError(f"model.config.num_attention_heads: {heads} heads do not divide hidden_size {hidden}")
    kv = getattr(config, "num_key_value_heads", None)
    if kv and heads % kv:
        raise UserError(f"model.config.num_key_value_heads: {kv} does not divide num_attention_heads {heads}")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise UserError(f"data.seq_len: {seq_len} exceeds the model's max_position_embeddings {max_pos}")
    if config.vocab_size < vocab_size:
        raise UserError(f"model.config.vocab_size: {config.vocab_size} is smaller than the tokenizer's {vocab_size}")


def build_model(section: ModelSection, config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[section.dtype]
    if section.pretrained:
        return AutoModelForCausalLM.from_pretrained(section.pretrained, config=config, dtype=dtype,
                                                    local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's list of decoder layers and its module path (model.layers, transformer.h, ...)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
            isinstance(m, GradientCheckpointingLayer) for m in module
        ):
            return name, module
    raise UserError(f"model: {type(model).__name__} has no list of transformers GradientCheckpointingLayer layers")


def model_flops_per_token(config, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token without recompute: 6N + 12·L·h·s (PaLM appendix B)."""
    return 6.0 * num_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def count_params(model: nn.Module, exclude_embeddings: bool = True) -> int:
    """Parameter count (works on ZeRO-3 partitioned params via ds_numel)."""
    total = 0
    for name, p in model.named_parameters():
        if exclude_embeddings and ("embed" in name or name.endswith("wte.weight") or name.endswith("wpe.weight")):
            continue
        total += getattr(p, "ds_numel", p.numel())
    return total

"""Build a transformers causal LM from a recipe: from config, or from a local directory."""
from __future__ import annotations

import difflib
from pathlib import Path

import torch
from torch import nn

from memtrain.errors import UserError
from memtrain.config.recipe import ModelSection

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_config(section: ModelSection, vocab_size: int, seq_len: int):
    """A transformers config for the recipe, checked for the mistakes users make most."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if section.pretrained:
        if not (Path(section.pretrained) / "config.json").is_file():
            raise UserError(f"model.pretrained: '{section.pretrained}' has no config.json")
        config = AutoConfig.from_pretrained(section.pretrained, local_files_only=True, **section.config)
        _check_shapes(lambda name: getattr(config, name, None), lambda name: name, vocab_size, seq_len)
    else:
        if section.type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(section.type, list(CONFIG_MAPPING.keys()), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"model.type: unknown transformers model type '{section.type}'{hint}")
        default = CONFIG_MAPPING[section.type]()
        known = set(default.to_dict()) | set(getattr(default, "attribute_map", {})) | {"attn_implementation"}
        for key in section.config:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise UserError(f"model.config.{key}: not a {section.type} config key{hint}")
        kwargs = {"vocab_size": vocab_size, **section.config}
        aliases = getattr(default, "attribute_map", {})  # generic name -> this family's name (n_embd, ...)

        def key(name):  # the spelling the user wrote, for messages
            return aliases[name] if aliases.get(name) in kwargs else name

        def value(name):
            # an unset num_key_value_heads means "same as num_attention_heads" to transformers
            fallback = None if name == "num_key_value_heads" else getattr(default, name, None)
            return kwargs.get(name, kwargs.get(aliases.get(name, name), fallback))

        # Check before transformers does: its own checks raise without naming the recipe key.
        _check_shapes(value, key, vocab_size, seq_len)
        try:
            config = AutoConfig.for_model(section.type, **kwargs)
        except Exception as e:  # transformers' config validators raise several types
            raise UserError(f"model.config: {str(e).strip().splitlines()[-1].strip()}") from None
    config.use_cache = False  # training never reads the KV cache
    return config


def _check_shapes(value, key, vocab_size: int, seq_len: int) -> None:
    for name in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        v = value(name)
        if v is not None and v <= 0:
            raise UserError(f"model.config.{key(name)}: must be positive (got {v})")
    hidden, heads, kv = value("hidden_size"), value("num_attention_heads"), value("num_key_value_heads")
    if hidden % heads:
        raise UserError(f"model.config.{key('num_attention_heads')}: {heads} heads do not divide "
                        f"{key('hidden_size')} {hidden}")
    if kv and heads % kv:
        raise UserError(f"model.config.num_key_value_heads: {kv} does not divide {key('num_attention_heads')} {heads}")
    max_pos = value("max_position_embeddings")
    if max_pos is not None and seq_len > max_pos:
        raise UserError(f"data.seq_len: {seq_len} exceeds the model's {key('max_position_embeddings')} {max_pos}")
    if value("vocab_size") < vocab_size:
        raise UserError(f"model.config.vocab_size: {value('vocab_size')} is smaller than the tokenizer's {vocab_size}")


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


"""Build a transformers causal LM from a recipe: from config, or from a local directory."""
from __future__ import annotations

import difflib
from pathlib import Path
import json

import torch
from torch import nn

from memtrain.errors import UserError, not_utf8
from memtrain.config.recipe import ModelSection
from memtrain.model.moe import route_experts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_config(section: ModelSection, vocab_size: int, seq_len: int):
    """A transformers config for the recipe, checked for the mistakes users make most."""
    from transformers import AutoConfig  # noqa: PLC0415 transformers: heavy, imported only when this runs
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415 transformers: heavy, imported only when this runs

    if section.pretrained:
        _check_pretrained_json(Path(section.pretrained) / "config.json", CONFIG_MAPPING)
        try:
            config = AutoConfig.from_pretrained(section.pretrained, local_files_only=True, **section.config)
        except Exception as e:  # transformers' config validators raise several types
            raise UserError(f"model.pretrained: {Path(section.pretrained) / 'config.json'}: "
                            f"{_first_line(e)}") from None
        _check_shapes(lambda name: getattr(config, name, None), lambda name: name, 0, seq_len)
        if config.vocab_size < vocab_size:  # ids past the embedding's rows: an index error in the first forward
            where = "model.config.vocab_size" if "vocab_size" in section.config else \
                f"vocab_size in {Path(section.pretrained) / 'config.json'}"
            raise UserError(f"data.tokenizer: its {vocab_size} token ids do not fit model.pretrained's "
                            f"{config.vocab_size} embedding rows ({where}); use the model's own tokenizer (the "
                            "default when data.tokenizer is unset and the pretrained directory holds one)")
    else:
        if section.type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(section.type, list(CONFIG_MAPPING.keys()), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"model.type: unknown transformers model type '{section.type}'{hint}")
        default = _quiet_default(CONFIG_MAPPING[section.type])
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

        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            # A family's default special ids (GPT-2's 50256) outside the tokenizer's vocabulary: training
            # never reads them, and transformers warns about each at every start. The user's own value stays.
            default_id = getattr(default, name, None)
            if name not in section.config and isinstance(default_id, int) and default_id >= value("vocab_size"):
                kwargs[name] = None
        # Check before transformers does: its own checks raise without naming the recipe key.
        _check_shapes(value, key, vocab_size, seq_len)
        try:
            config = AutoConfig.for_model(section.type, **kwargs)
        except Exception as e:  # transformers' config validators raise several types
            message = str(e).strip().splitlines()[-1].strip()
            named = [k for k in section.config if f"'{k}'" in message]  # "Field 'rms_norm_eps' expected float"
            raise UserError(f"model.config{'.' + named[0] if named else ''}: {message}") from None
        _check_dropout(section.config)
    config.use_cache = False  # training never reads the KV cache
    route_experts(config)  # MoE: torch's grouped matmul for bf16, transformers' fallback op otherwise
    return config


def _quiet_default(config_class):
    """The family's default config, for its key names and defaults only: transformers' warnings about it
    (StarCoder2's default bos/eos ids outside its default vocabulary) are not about the user's model."""
    from transformers.utils import logging  # noqa: PLC0415 transformers: heavy, imported only when this runs

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return config_class()
    finally:
        logging.set_verbosity(level)


def _check_dropout(values: dict) -> None:
    """Dropout probabilities (attention_dropout, resid_pdrop, ...): transformers stores them unchecked and
    torch's functional dropout only refuses them in the first forward, after distributed start-up."""
    for key, v in values.items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool) \
                and not 0 <= v <= 1:
            raise UserError(f"model.config.{key}: {v} is not a dropout probability; expected a number in [0, 1]")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0].strip()


def _check_pretrained_json(path: Path, known) -> None:
    """What AutoConfig would report as a traceback (or a list of every model type): one line."""
    if not path.is_file():
        raise UserError(f"model.pretrained: '{path.parent}' has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"model.pretrained: {path}: {not_utf8(e)}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"model.pretrained: {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}"
                        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"model.pretrained: {path}: expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("model_type")
    if kind is None:
        raise UserError(f"model.pretrained: {path}: no 'model_type' key (expected a transformers model type, "
                        "e.g. \"llama\")")
    if kind not in known:
        close = difflib.get_close_matches(str(kind), list(known.keys()), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"model.pretrained: {path}: model_type: unknown transformers model type {kind!r}{hint}")


def build_on_meta(section: ModelSection, config) -> nn.Module:
    """The model on the meta device (no memory, no weights read): transformers' own checks of every
    config value run, as they will when the workers build it. One line naming the key on failure."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 transformers: heavy, imported only when this runs

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=_DTYPES[section.dtype])
    except Exception as e:  # a negative size, an unknown activation name, an unsupported combination
        message = _first_line(e) if not isinstance(e, KeyError) else f"{e.args[0]!r} is not a name it knows"
        keys = [k for k, v in section.config.items() if _blamed(v, message)]
        where = f"model.config.{keys[0]}" if keys else ("model.pretrained" if section.pretrained else "model.config")
        if where.endswith("_act") or where.endswith("activation_function"):
            from transformers.activations import ACT2CLS  # noqa: PLC0415 transformers: heavy, imported only when this runs

            message += f"; {_activation_hint(section.config[where.split('.')[-1]], ACT2CLS)}"
        raise UserError(f"{where}: transformers cannot build {config.model_type} with it: {message}") from None


def _activation_hint(name, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"did you mean '{close[0]}'?" if close else f"known: {', '.join(sorted(known))}"


def _blamed(value, message: str) -> bool:
    """Does the error message mention this config value (or is it a negative size)?"""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (int, float)) and value < 0:
        return True
    return isinstance(value, str) and len(value) > 1 and value in message


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


def model_class(config) -> type:
    """The transformers causal-LM class that `build_model` makes for `config`; the lazy mapping imports the
    family's modeling module."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415 transformers: heavy, imported only when this runs

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def build_model(section: ModelSection, config) -> nn.Module:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 transformers: heavy, imported only when this runs

    dtype = _DTYPES[section.dtype]
    if section.pretrained:
        return AutoModelForCausalLM.from_pretrained(section.pretrained, config=config, dtype=dtype,
                                                    local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's list of decoder layers and its module path (model.layers, transformer.h, ...)."""
    from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415 transformers: heavy, imported only when this runs

    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
            isinstance(m, GradientCheckpointingLayer) for m in module
        ):
            return name, module
    raise UserError(f"model: {type(model).__name__} has no list of transformers GradientCheckpointingLayer layers")


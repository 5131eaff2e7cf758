"""Build a model under `deepspeed.zero.Init` (ZeRO-3) and give it transformers' own weight initialisation.

transformers only runs its ZeRO-3 path (`initialize_weights_zero3`: gather each module's shards,
run `_initialize_weights` on rank 0) when `is_deepspeed_zero3_enabled()`, which needs an
`HfDeepSpeedConfig` and therefore `accelerate`. Without it, a model built from config under a bare
`zero.Init` is initialised on empty shards: its weights keep torch's defaults (embedding std 1.0,
projections kaiming) instead of the model's `_init_weights` (std 0.02). Here we run transformers'
own functions for that path ourselves, so nothing of theirs is written again.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from memtrain.config.recipe import ModelSection
from memtrain.model.build import build_model, model_class


def build_model_zero3(section: ModelSection, config, ds_config: dict) -> nn.Module:
    """`build_model` under `deepspeed.zero.Init(ds_config)`; a from-config model then gets
    transformers' initialisation, module by module (only one module's parameters gathered at a time)."""
    import deepspeed  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from transformers.integrations.deepspeed import initialize_weights_zero3, prevent_arange_dtype_change  # noqa: PLC0415 transformers: heavy, imported only when this runs

    _import_model_class(config)
    if section.pretrained:
        return _load_pretrained_zero3(section, config, ds_config)

    # prevent_arange_dtype_change: zero.Init casts tensor constructors to the training dtype; RoPE's
    # inv_freq must keep the float32 arange transformers asks for (as transformers' own ZeRO-3 path does).
    with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config), \
            _no_model_init(not section.pretrained):
        model = build_model(section, config)
    if section.pretrained:  # loaded weights, not initialised ones
        return model
    # construction ran the init on empty shards and marked every module initialised: undo the marks
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    initialize_weights_zero3(model)  # gathers with modifier_rank=0: rank 0 initialises, all ranks get it
    model.tie_weights()
    return model


def _load_pretrained_zero3(section: ModelSection, config, ds_config: dict) -> nn.Module:
    """A pretrained directory under ZeRO-3, loaded as transformers loads it for its own Trainer: with its
    DeepSpeed config registered (`HfDeepSpeedConfig`), `from_pretrained` builds under `zero.Init` and copies
    each checkpoint tensor into its partitioned parameter (gathered one at a time). Without it, transformers
    would see every partitioned parameter's empty shape as a size mismatch and re-initialise it."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, prevent_arange_dtype_change, \
        unset_hf_deepspeed_config  # noqa: PLC0415 transformers: heavy, imported only when this runs

    registered = HfDeepSpeedConfig(ds_config)  # transformers keeps a weak reference: hold it while loading
    try:
        with prevent_arange_dtype_change():
            model = build_model(section, config)
    finally:
        unset_hf_deepspeed_config()
        del registered
    return model


def _import_model_class(config) -> None:
    """Import the family's modeling module before zero.Init is entered. zero.Init wraps the `__init__` of every
    module class defined while it is active and puts back, on exit, the `__init__` the class was defined with.
    transformers imports a family's module on first use and decorates some classes after their definition
    (`use_experts_implementation` wraps the MoE experts' `__init__` to keep the config): a module first imported
    inside zero.Init loses those wrappers for the rest of the process (MixtralExperts without `config`)."""
    model_class(config)


@contextmanager
def _no_model_init(skip: bool):
    """Skip transformers' whole-model init (`PreTrainedModel.init_weights`, run by `post_init`) while zero.Init
    builds the model: it would run on empty shards, where an init that indexes a weight (an embedding's
    `padding_idx` row, in Gemma, Phi-3, OLMo-2) fails. `initialize_weights_zero3` runs it afterwards on the
    gathered parameters. torch's own per-module init (reset_parameters) still runs, before each partition."""
    if not skip:
        yield
        return
    from transformers import PreTrainedModel  # noqa: PLC0415 transformers: heavy, imported only when this runs

    original = PreTrainedModel.init_weights
    PreTrainedModel.init_weights = lambda self: None
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original

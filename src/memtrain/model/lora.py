"""LoRA adapters with peft: added to the built model in place, merged into `final/` with the adapter beside it.

`model.lora` in a recipe adds peft's LoRA layers to the transformers model memtrain built (under
ZeRO-3 too: the model's own weights are already partitioned, and `deepspeed.initialize` partitions the
new adapter weights, broadcasting rank 0's, as it does for any parameter built outside `zero.Init`).
peft marks only the adapters trainable; `train.trainable` / `train.frozen` then add or take out
parameters (memtrain.model.freeze). The model keeps its class and its module paths (a target linear
layer becomes a peft `lora.Linear` whose `base_layer` is the original), so recompute policies,
module patterns and the ZeRO-3 leaf layers apply unchanged.

At the end, `final/` holds the merged model (the adapters folded into the weights: a plain transformers
model that `AutoModelForCausalLM.from_pretrained` loads) and `final/adapter/` the adapters alone, in
peft's format (`PeftModel.from_pretrained(base, final/adapter)`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional
from contextlib import ExitStack
from unittest import mock

from torch import nn
import torch

from memtrain.config.recipe import LoraSection
from memtrain.errors import UserError

ADAPTER_DIR = "adapter"


def lora_config(section: LoraSection, modules_to_save: tuple[str, ...] = ()):
    """peft's LoraConfig. `modules_to_save` (module paths) only when saving: while training those modules train in
    place (their parameters join train.trainable), never as peft's copies, which ZeRO-3's partitioned weights
    cannot be copied into."""
    from peft import LoraConfig  # noqa: PLC0415 peft: heavy, imported only when this runs

    targets = section.target_modules if isinstance(section.target_modules, str) else list(section.target_modules)
    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=targets,
                      use_rslora=section.use_rslora, use_dora=section.use_dora,
                      modules_to_save=list(modules_to_save) or None, bias="none", task_type="CAUSAL_LM")


def add_lora(model: nn.Module, section: LoraSection, dtype=None, modules_to_save: tuple[str, ...] = ()):
    """Adds the adapters to `model` in place (it keeps its class and module paths); returns peft's wrapper
    around it, for saving. Only the adapters train. UserError (one line) when no module matches.

    `dtype`: create the adapters in this dtype on the current default device and leave them there: the
    planner's fake-tensor model (memtrain.memory.profile), where they already are where peft would move
    them, and where `Module.to` fails (torch 2.13 cannot swap a fake parameter that the fake mode holds a
    weak reference to)."""
    from peft import get_peft_model  # noqa: PLC0415 peft: heavy, imported only when this runs

    try:
        with ExitStack() as stack:
            if dtype is not None:
                stack.enter_context(mock.patch.object(nn.Module, "to", lambda self, *a, **k: self))
                default = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                stack.callback(torch.set_default_dtype, default)
            # the adapters in their base layer's dtype, never peft's fp32 upcast: DeepSpeed's bf16/fp16 optimizer keeps
            # every trained weight's fp32 master, and a ZeRO-3 model (built in bf16) kept fp32 adapters, so each
            # adapted linear layer cast its input to fp32 and kept it for the backward (H100, llama-1b, LoRA r 16 on
            # every linear: 1.28 GiB over the planner's peak, and ZeRO-1/2, whose engine casts the whole model, differed)
            return get_peft_model(model, lora_config(section, modules_to_save), autocast_adapter_dtype=False)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(f"model.lora.target_modules: {str(e).splitlines()[0]} (its linear layers: "
                        f"{', '.join(names)})") from None


def is_adapter(name: str) -> bool:
    """A parameter of a LoRA adapter (peft names them lora_A / lora_B / lora_embedding_*)."""
    return ".lora_" in name


def _matches(path: str, name: str) -> bool:
    """peft's modules_to_save matching, at a dot: the module's path or its last parts."""
    return path == name or path.endswith("." + name)


def trainable_patterns(model: nn.Module, section: Optional[LoraSection], trainable) -> list[str]:
    """train.trainable with the parameters of model.lora.modules_to_save's modules (they train whole, as with peft);
    UserError (one line) for a name that matches no module."""
    patterns = list(trainable)
    for name in (section.modules_to_save if section is not None else ()):
        found = [f"{path}.{p}" if path else p for path, module in model.named_modules() if _matches(path, name)
                 for p, _ in module.named_parameters()]
        if not found:
            raise UserError(f"model.lora.modules_to_save: '{name}' names no module of {type(model).__name__} with "
                            "parameters (a module's path or its last parts, e.g. lm_head)")
        patterns += found
    return patterns


def saved_modules(model: nn.Module, trained: set[str]) -> tuple[str, ...]:
    """The modules that hold every non-adapter parameter that trains (`trained`: names, memtrain.model.freeze), which
    final/adapter keeps whole (peft's modules_to_save). UserError (one line) for one that peft cannot keep there: a
    parameter of a layer LoRA adapts, or of the model itself."""
    lora_layers = {path for path, m in model.named_modules() if hasattr(m, "lora_A")}
    paths = set()
    for name in sorted(n for n in trained if not is_adapter(n)):
        path = name.rpartition(".")[0]
        inside = next((layer for layer in lora_layers if path == layer or path.startswith(layer + ".")), None)
        if inside is not None or not path:
            why = f"sits in {inside}, a layer LoRA adapts" if inside else "belongs to no submodule"
            raise UserError(f"train.trainable: {name} trains beside the LoRA adapters but {why}, so final/adapter "
                            "(peft's modules_to_save) cannot hold it; leave it out of train.trainable"
                            + (" or its layer out of model.lora.target_modules" if inside else ""))
        paths.add(path)
    return tuple(sorted(paths))


def _wrapped_state(peft_model, state: dict) -> dict:
    """`state` (the trained model's names) under the names peft gives a modules_to_save module: its trained copy
    (what the adapter saves) and the original it wraps."""
    from peft.utils.other import ModulesToSaveWrapper  # noqa: PLC0415 peft: heavy, imported only when this runs

    model = peft_model.base_model.model
    tied = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", False):  # a state that names one copy
        state = {**{target: state[source] for target, source in tied.items() if source in state}, **state}
    wrapped = [path for path, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    out = {}
    for key, value in state.items():
        path = next((p for p in wrapped if key.startswith(p + ".")), None)
        if path is None:
            out[key] = value
            continue
        rest = key[len(path) + 1:]
        out[f"{path}.modules_to_save.default.{rest}"] = out[f"{path}.original_module.{rest}"] = value
    return out


def save_merged(model_factory, section: LoraSection, state: dict, out: Path, modules_to_save: tuple[str, ...] = ()) -> None:
    """`out`: the merged model; `out/adapter`: the adapters, with `modules_to_save` (module paths: what trained whole
    beside them, memtrain.model.freeze.saved_with_adapters) in peft's modules_to_save. `state` is the trained model's
    full state dict (the adapted model's own names); `model_factory()` builds the untrained base model on the CPU."""
    peft_model = add_lora(model_factory(), section, modules_to_save=modules_to_save)
    missing, unexpected = peft_model.base_model.model.load_state_dict(_wrapped_state(peft_model, state), strict=False)
    tied = set(getattr(peft_model.base_model.model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise RuntimeError(f"LoRA export: state dict does not fit the adapted model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    peft_model.save_pretrained(out / ADAPTER_DIR, safe_serialization=True)
    peft_model.merge_and_unload().save_pretrained(out, safe_serialization=True)

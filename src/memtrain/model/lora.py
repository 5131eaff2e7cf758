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

from torch import nn

from memtrain.config.recipe import LoraSection

ADAPTER_DIR = "adapter"


def lora_config(section: LoraSection):
    from peft import LoraConfig

    targets = section.target_modules if isinstance(section.target_modules, str) else list(section.target_modules)
    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def add_lora(model: nn.Module, section: LoraSection, dtype=None):
    """Adds the adapters to `model` in place (it keeps its class and module paths); returns peft's wrapper
    around it, for saving. Only the adapters train. UserError (one line) when no module matches.

    `dtype`: create the adapters in this dtype on the current default device and leave them there: the
    planner's fake-tensor model (memtrain.memory.profile), where they already are where peft would move
    them, and where `Module.to` fails (torch 2.13 cannot swap a fake parameter that the fake mode holds a
    weak reference to)."""
    from contextlib import ExitStack
    from unittest import mock

    import torch
    from peft import get_peft_model

    from memtrain.errors import UserError

    try:
        with ExitStack() as stack:
            if dtype is not None:
                stack.enter_context(mock.patch.object(nn.Module, "to", lambda self, *a, **k: self))
                default = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                stack.callback(torch.set_default_dtype, default)
            return get_peft_model(model, lora_config(section), autocast_adapter_dtype=dtype is None)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(f"model.lora.target_modules: {str(e).splitlines()[0]} (its linear layers: "
                        f"{', '.join(names)})") from None


def is_adapter(name: str) -> bool:
    """A parameter of a LoRA adapter (peft names them lora_A / lora_B / lora_embedding_*)."""
    return ".lora_" in name


def save_merged(model_factory, section: LoraSection, state: dict, out: Path) -> None:
    """`out`: the merged model; `out/adapter`: the adapters alone. `state` is the trained model's full state
    dict (the adapted model's own names); `model_factory()` builds the untrained base model on the CPU."""
    peft_model = add_lora(model_factory(), section)
    missing, unexpected = peft_model.base_model.model.load_state_dict(state, strict=False)
    tied = set(getattr(peft_model.base_model.model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied]:
        raise RuntimeError(f"LoRA export: state dict does not fit the adapted model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    peft_model.save_pretrained(out / ADAPTER_DIR, safe_serialization=True)
    peft_model.merge_and_unload().save_pretrained(out, safe_serialization=True)

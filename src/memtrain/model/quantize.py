"""A 4-bit base for QLoRA (`model.quantization`): the built model's linear layers swapped for bitsandbytes' Linear4bit.

Every `nn.Linear` but the output head (and a family's `_keep_in_fp32_modules`) becomes a `bnb.nn.Linear4bit` whose
frozen weight is quantized from the built one (NF4 or FP4, blocks of 64 with an absmax each, the absmaxes quantized
again with `double_quant`), on the device the rank trains on: what transformers' `BitsAndBytesConfig` path does in
`from_pretrained`, here on a model built from config or loaded from a local directory alike. The model is marked
`is_loaded_in_4bit`, so peft's LoRA wraps those layers with its bitsandbytes adapters. Embeddings, norms and the head
keep the model's dtype.

peft's `prepare_model_for_kbit_training` is not called: it freezes the base (memtrain.model.freeze does), turns on
transformers' gradient checkpointing (memtrain.recompute does) and casts every other weight to float32 (DeepSpeed's
bf16 casts them back; the model's dtype decides).

At the end the adapters are merged into the base as it trained: each 4-bit weight dequantized (`dequantized_state`).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from memtrain.config.recipe import QuantizationSection
from memtrain.config.ds_config import engine_dtype, zero_stage

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def quantized_layers(model: nn.Module) -> list[str]:
    """The paths of the linear layers a 4-bit base stores in 4 bits: every `nn.Linear` but the output head and the
    family's float32 modules (on any device, meta included; before or after LoRA wraps them)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    paths = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head and ".lora_" not in path \
                and not any(k in path.split(".") for k in keep):
            paths.append(path)
    return paths


def quantize_base(model: nn.Module, section: QuantizationSection, compute_dtype: str, device,
                  storage_dtype: str = "uint8") -> int:
    """Swaps the linear layers of `quantized_layers` for bitsandbytes' Linear4bit in place, quantized on `device`
    (the rank's device: its 4-bit kernels run there); `compute_dtype` and `storage_dtype` when the section names
    none. Returns how many layers."""
    import bitsandbytes as bnb  # noqa: PLC0415 bitsandbytes: heavy, imported only when this runs

    dtype = _DTYPES[section.compute_dtype or compute_dtype]
    storage = _DTYPES[section.storage_dtype or storage_dtype]
    paths = quantized_layers(model)
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, name)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None, compute_dtype=dtype,
                                compress_statistics=section.double_quant, quant_type=section.type,
                                quant_storage=storage, device="meta")
        new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, compress_statistics=section.double_quant,
                                       quant_type=section.type, quant_storage=storage, module=new)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        # on a CPU with AVX512-BF16, a forward in eval mode without grad (a held-out eval) would repack the weight in
        # place into bitsandbytes' CPU inference layout, which its training kernels, saving and ZeRO-3 do not read
        new.support_avx512bf16_for_cpu = False
        setattr(parent, name, new.to(device))  # Params4bit.to quantizes on its first move to a device
    model.to(device)
    model.is_loaded_in_4bit = True  # peft's dispatch to its bitsandbytes LoRA layers reads it
    return len(paths)


def packed_shapes(model: nn.Module) -> dict[str, set[tuple[int, ...]]]:
    """The shapes a checkpoint of the 4-bit base holds for each weight of `quantized_layers` (on the unquantized
    model, meta included): bitsandbytes packs two codes a byte into a column of uint8, bfloat16/float16 or float32."""
    return {f"{path}.weight": {(-(-model.get_submodule(path).weight.numel() // 2) // size, 1) for size in (1, 2, 4)}
            for path in quantized_layers(model)}


def quantize_for_engine(model: nn.Module, section: QuantizationSection, ds_config: dict) -> int:
    """`quantize_base` on this rank's device (DeepSpeed's accelerator), computing in the resolved JSON's dtype."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    dtype = engine_dtype(ds_config)
    return quantize_base(model, section, dtype, get_accelerator().current_device_name(),
                         storage_dtype(section, ds_config))


def storage_dtype(section: QuantizationSection, ds_config: dict) -> str:
    """model.quantization.storage_dtype, or its default: under ZeRO-3 the dtype DeepSpeed computes in, else uint8."""
    return section.storage_dtype or (engine_dtype(ds_config) if zero_stage(ds_config) == 3 else "uint8")


def _quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    import bitsandbytes as bnb  # noqa: PLC0415 bitsandbytes: heavy, imported only when this runs

    return {path: m for path, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def dequantized_state(model: nn.Module, state: dict) -> dict:
    """`state` (the trained model's state dict: its own, or ZeRO-3's consolidated one) with each 4-bit weight as the
    dense weight it stood for in the forward (dequantized in its compute dtype, then the dtype of the model's other
    weights) and without bitsandbytes' quant-state entries: what an unquantized base of the same shape loads."""
    import bitsandbytes.functional as F  # noqa: PLC0415 bitsandbytes: heavy, imported only when this runs

    quantized = _quantized_modules(model)
    dense = next((v.dtype for k, v in state.items() if v.is_floating_point() and not _under(k, quantized)), None)
    out = {}
    for key, value in state.items():
        path, _, leaf = key.rpartition(".")
        if path in quantized and leaf == "weight":
            qs = quantized[path].weight.quant_state
            packed = value.to(qs.absmax.device).contiguous().view(torch.uint8)
            out[key] = F.dequantize_4bit(packed, qs).to(dense or qs.dtype).cpu()
        elif not _under(key, quantized, quant_state_only=True):
            out[key] = value
    return out


def _under(key: str, quantized: Iterable[str], quant_state_only: bool = False) -> bool:
    """Is `key` a 4-bit layer's weight (or, `quant_state_only`, one of the quant-state entries bitsandbytes adds to
    its state dict: weight.absmax, weight.quant_map, weight.nested_*, weight.quant_state.*)?"""
    for path in quantized:
        if quant_state_only and key.startswith(path + ".weight."):
            return True
        if not quant_state_only and key == path + ".weight":
            return True
    return False

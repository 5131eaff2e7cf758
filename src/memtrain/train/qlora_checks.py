"""What a 4-bit base (model.quantization, QLoRA) cannot run with: one UserError line each, before any worker starts.

- ZeRO-3 partitions the 4-bit weights with the rest, which it flattens in one dtype: the packed codes must be stored
  in the dtype DeepSpeed computes in (bitsandbytes' quant_storage, as transformers and accelerate document for
  DeepSpeed ZeRO-3 and FSDP).
- Under every stage DeepSpeed's bf16/fp16 casts every floating parameter to its dtype: codes stored in another float
  dtype would be cast as numbers, and so destroyed. uint8 (the default) is never cast.
- ZeRO-3's parameter offload, AutoTP (refused for LoRA already), Ulysses sequence parallelism and train.compile are
  not tested with bitsandbytes' 4-bit layers: refused rather than run untested.
"""
from __future__ import annotations

from memtrain.config.ds_config import engine_dtype, offload_device, zero_stage
from memtrain.errors import UserError
from memtrain.model.quantize import storage_dtype


def check_quantized_base(resolved: dict, recipe, source: str, compiled: bool) -> None:
    """One line for the first thing the recipe's 4-bit base cannot run with under the resolved JSON."""
    section = recipe.model.quantization
    if section is None:
        return
    dtype, storage = engine_dtype(resolved), storage_dtype(section, resolved)
    if zero_stage(resolved) == 3 and storage != dtype:
        raise UserError(f"{source}: zero_optimization.stage: 3 partitions the 4-bit weights with the rest, in the "
                        f"dtype DeepSpeed computes in ({dtype}), but the recipe's model.quantization.storage_dtype is "
                        f"{storage}; set model.quantization.storage_dtype: {dtype}")
    if storage not in ("uint8", dtype):
        raise UserError(f"{source}: DeepSpeed computes in {dtype} and would cast the 4-bit codes stored as the "
                        f"recipe's model.quantization.storage_dtype {storage}; use uint8 or {dtype}")
    if offload_device(resolved, "param") in ("cpu", "nvme"):
        raise UserError(f"{source}: zero_optimization.offload_param: a 4-bit base (the recipe's model.quantization) "
                        "is not offloaded (untested with bitsandbytes' layers; at half a byte a weight it rarely "
                        "needs to be); remove offload_param (offload_optimizer is fine)")
    if recipe.parallel.sequence > 1:
        raise UserError(f"{source}: parallel.sequence {recipe.parallel.sequence} with model.quantization: Ulysses "
                        "sequence parallelism is not tested with a 4-bit base; use parallel.sequence 1")
    if compiled:
        raise UserError(f"{source}: train.compile with model.quantization: bitsandbytes' 4-bit layers are not tested "
                        "under torch.compile; set train.compile false")

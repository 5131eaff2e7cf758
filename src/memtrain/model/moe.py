"""MoE experts: which of transformers' grouped expert matmuls a run uses, for its dtype and device.

transformers 5 runs routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) as `grouped_mm`: one grouped matmul
over every token-expert pair, sorted by expert. It calls torch's `grouped_mm` wherever torch has one, and its
own `transformers::grouped_mm_fallback` op (a matmul per expert, the same tensors saved for backward) only
under torch.compile or on old CPU kernels. But torch's grouped matmul takes bf16 only on CUDA, and its meta
kernel, which fake tensors run (memtrain's memory model), says so on every device: an fp32 or fp16 MoE
cannot be trained on a GPU nor planned anywhere.

So memtrain sends other dtypes to transformers' fallback op. Not "eager" (a Python loop over experts with
a `nonzero` per layer: fake tensors cannot run it) nor "batched_mm" (it gathers every token's expert
weights: 50x the activation memory of the grouped matmul at a tiny shape, measured with fake tensors).
The fallback saves what the grouped matmul saves, so the plan's memory figures hold for both; it costs
one host sync per expert matmul (`offs.tolist()`), which bf16 runs on a GPU do not pay.
"""
from __future__ import annotations

import functools

import torch

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def has_routed_experts(config) -> bool:
    """Does this transformers config build routed experts?"""
    return any(isinstance(getattr(config, key, None), int) and getattr(config, key) > 1 for key in _EXPERT_KEYS)


def route_experts(config) -> None:
    """Make transformers' grouped experts take torch's grouped matmul for bf16 only (see the module docstring).
    Idempotent; a no-op for a config without routed experts."""
    if not has_routed_experts(config):
        return
    from transformers.integrations import moe  # noqa: PLC0415 transformers: heavy, imported only when this runs

    if getattr(moe._can_use_grouped_mm, "memtrain_bf16_only", False):
        return
    original = moe._can_use_grouped_mm

    @functools.wraps(original)
    def bf16_only(input, weight, offs):
        return weight.dtype == torch.bfloat16 and original(input, weight, offs)

    bf16_only.memtrain_bf16_only = True
    moe._can_use_grouped_mm = bf16_only


def experts_line(config, dtype: str) -> str:
    """The plan line: which expert matmul the run uses, and why; '' without routed experts."""
    if not has_routed_experts(config):
        return ""
    if dtype == "bfloat16":
        return "moe experts: torch's grouped matmul (bf16), one kernel per projection for all experts"
    return (f"moe experts: transformers' grouped_mm fallback, a matmul per expert ({dtype}: torch's grouped matmul "
            "takes bf16 only); set model.dtype: bfloat16 for the grouped kernel")

"""The DeepSpeed JSON and recipe of one configuration of the whole-configuration search (memtrain.memory.search).

A family (TP, SP, activation offload) fixes `tensor_parallel` and `activation_checkpointing.cpu_checkpointing`;
a ZeRO variant its stage and offloads; the recipe its micro-batch, gradient accumulation, SP degree and
`policy: auto` under the search's GPU budget. Batch keys stay "auto": the recipe fills them.
"""
from __future__ import annotations

import copy
from typing import Optional


def family_ds(base: dict, tp: int, activation_offload: bool) -> dict:
    ds = copy.deepcopy(base)
    ac = ds.setdefault("activation_checkpointing", {})
    ac["cpu_checkpointing"] = activation_offload
    if tp > 1:
        ds["tensor_parallel"] = {"autotp_size": tp}
    else:
        ds.pop("tensor_parallel", None)
    return ds


def variant_ds(ds: dict, stage: int, offload_optimizer: bool, offload_param: bool) -> dict:
    out = copy.deepcopy(ds)
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = stage
    for key, on in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if on:
            zero[key] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop(key, None)
    return out


def family_recipe(recipe, sp: int, micro_batch: int = 1, grad_accum: int = 1, budget_gib: Optional[float] = None):
    r = recipe.model_copy(deep=True)
    r.parallel.sequence = sp
    r.train.micro_batch_size = micro_batch
    r.train.grad_accum_steps = grad_accum
    r.activation_checkpointing.policy = "auto"
    if budget_gib is not None:
        r.activation_checkpointing.memory_budget = budget_gib  # unrounded: rounding down would shrink it
    return r

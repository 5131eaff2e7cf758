"""DeepSpeed's partitioned activation checkpoints across the tensor-parallel group: configure them after
`deepspeed.initialize`, keep callers' tensors intact, count what DeepSpeed holds on its autograd context,
and say in the start-up plan what is partitioned and how many bytes each rank keeps."""
from __future__ import annotations

from typing import Optional
import dataclasses

import torch

from memtrain.recompute.offload import StorageAlias


def tp_mpu(plan, tp: int):
    """The `mpu_` for `deepspeed.checkpointing.configure` (`memtrain.recompute.hooks.configure_deepspeed_ac`):
    `deepspeed.utils.groups`, the module the engine itself uses as its mpu, when the run has a
    tensor-parallel group; None without one.

    Configure must run after `deepspeed.initialize`: the TP groups are created inside it, and
    `configure` reads the group size once. With `mpu_=None` DeepSpeed's mp_size stays 1 and
    partitioning silently shards nothing."""
    if tp <= 1:
        return None
    from deepspeed.utils import groups  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    if groups._TENSOR_MODEL_PARALLEL_GROUP is None:
        raise RuntimeError("partitioned activation checkpoints: configure after deepspeed.initialize, "
                           "which creates the tensor-parallel group")
    return groups


def check_configured(plan, tp: int) -> None:
    """DeepSpeed shards across exactly the run's tensor-parallel group (not silently across none)."""
    if plan.partition_activations and plan.backend == "deepspeed":
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        if ds_checkpointing.mp_size != tp:
            raise RuntimeError(f"partitioned activation checkpoints: DeepSpeed shards across {ds_checkpointing.mp_size} "
                               f"ranks, the tensor-parallel group has {tp}")


def empties_inputs() -> bool:
    """Whether DeepSpeed's checkpoint will empty its callers' input tensors in place
    (`arg.data = torch.empty([])`): it does when it partitions or copies them to host itself."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    return bool(ds_checkpointing.PARTITION_ACTIVATIONS or ds_checkpointing.CPU_CHECKPOINT)


def protect_inputs(args: tuple) -> tuple:
    """Hand DeepSpeed aliases of the floating-point inputs (same storage, not views) so that emptying
    them in place leaves the caller's tensors whole: a model returning `output_hidden_states` holds a
    layer's input and must not see a shape-() tensor. Memory is freed as before once the caller drops it."""
    return tuple(StorageAlias.apply(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def saved_by_deepspeed(args) -> list[torch.Tensor]:
    """What DeepSpeed's checkpoint (either one) keeps for the backward of the call it got `args` for.
    It keeps the input tensor objects themselves (`deepspeed_saved_tensors`: on the reentrant
    function's autograd context, in the non-reentrant one's closure), not autograd saved tensors,
    so saved-tensor hooks never see them. When it partitions or copies an input to the host, it
    empties that object in place and hangs what it really keeps on it as `.saved_data`."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            data = getattr(x, "saved_data", None)
            out.append(x if data is None else data)
    return out


def partition_line(plan, tp: int, checkpoint_input_bytes: Optional[int]) -> Optional[str]:
    """The start-up plan's line for a run with a tensor-parallel group (None without one)."""
    if tp <= 1 or not plan.partition_activations:
        return None
    line = f"partition_activations: on, checkpointed inputs sharded across the tensor-parallel group of {tp}"
    if checkpoint_input_bytes:
        line += (f": {checkpoint_input_bytes // tp:,} B per rank per micro-batch instead of "
                 f"{checkpoint_input_bytes:,} B")
    return line


def checkpoint_input_bytes(plan, config, micro_batch: int, seq_len: int, dtype_bytes: int) -> Optional[int]:
    """Bytes of one forward's checkpointed inputs on one rank, unpartitioned: one hidden state
    (micro_batch x seq_len x hidden) per checkpoint call. None where the calls are not known before
    the model is built (policy 'modules')."""
    if plan.modules:
        return None
    calls = len(plan.offload_units)
    return calls * micro_batch * seq_len * config.hidden_size * dtype_bytes


def with_expected_bytes(plan, config, recipe, resolved_ds_config: dict):
    """`plan` with `checkpoint_input_bytes` filled when its checkpoints are partitioned (for the plan line)."""
    if plan.tp_size <= 1 or not plan.partition_activations:
        return plan
    half = any((resolved_ds_config.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16"))
    dtype_bytes = 2 if half else torch.finfo(getattr(torch, recipe.model.dtype)).bits // 8
    return dataclasses.replace(plan, checkpoint_input_bytes=checkpoint_input_bytes(
        plan, config, recipe.train.micro_batch_size, recipe.data.seq_len, dtype_bytes))

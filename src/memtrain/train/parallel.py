"""The run's parallel layout: tensor-parallel size from the JSON, checked before any worker starts;
after `deepspeed.initialize`, which data-parallel rank a process is (it picks the batch) and how many
ranks read distinct data (it counts tokens), as DeepSpeed's own groups say."""
from __future__ import annotations

from dataclasses import dataclass

from memtrain.errors import UserError


def check_autotp_model(ds_config: dict, source: str, model) -> None:
    """Can DeepSpeed's AutoTP shard this model (meta device)? What deepspeed.initialize decides inside every
    worker, asked before they start: the model's transformers tp_plan, where it has one, must use only partition
    styles DeepSpeed takes (Phi-3's and OLMo-2's `rowwise_split_input`, the MoE families' `moe_tp_experts` are
    refused as a whole), and a model without one needs an AutoTP policy (GPT-2 has none). An explicit
    `tensor_parallel.partition_config` is the user's plan: DeepSpeed applies it, nothing to check here."""
    section = ds_config.get("tensor_parallel")
    if not isinstance(section, dict) or section.get("autotp_size", 0) <= 1 or section.get("partition_config"):
        return
    from deepspeed.module_inject.auto_tp import AutoTP  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter  # noqa: PLC0415 deepspeed: heavy, imported only when this runs
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    kind = getattr(model.config, "model_type", type(model).__name__)
    plan = _get_hf_tp_plan(model)
    if plan:
        try:
            TPPlanConverter.convert(plan)
        except ValueError:
            styles = sorted({s for s in plan.values() if s.lower() not in _supported_styles()})
            raise UserError(f"{source}: tensor_parallel.autotp_size: DeepSpeed's AutoTP cannot shard {kind}: its "
                            f"transformers tp_plan uses partition styles DeepSpeed does not take ({', '.join(styles)}); "
                            "give tensor_parallel.partition_config for it, or set autotp_size 1") from None
        return
    try:
        supported = AutoTP.supported(model)
    except AssertionError:  # no model class name it can read a policy from
        supported = False
    if not supported:
        raise UserError(f"{source}: tensor_parallel.autotp_size: DeepSpeed's AutoTP has no policy for {kind} (no "
                        "transformers tp_plan); give tensor_parallel.partition_config for it, or set autotp_size 1")


def _supported_styles() -> set:
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    return SUPPORTED_STYLES


@dataclass(frozen=True)
class Layout:
    """Where this rank sits. Ranks of one tensor-parallel group read the same batch (DeepSpeed checks
    it at the first forward) and count its tokens once."""

    world: int
    tp: int
    dp_rank: int
    dp_size: int
    tp_rank: int = 0  # this rank's place in its tensor-parallel group (its shard)

    def tokens_per_step(self, micro_batch: int, grad_accum: int, seq_len: int) -> int:
        return self.dp_size * micro_batch * grad_accum * seq_len

    def loss_divisor(self, step_tokens: int, grad_accum: int) -> float:
        """What each micro-step divides its summed token loss by (memtrain.model.loss.normalise), given the
        labelled tokens of the whole optimizer step over all micro-steps and data ranks (`step_tokens`, known
        from the data on every rank: memtrain.model.order). DeepSpeed 0.19.8's engine.backward divides the loss
        by grad_accum, and ZeRO averages the gradients over the data-parallel replicas (ranks of a tensor- or
        sequence-parallel group hold one replica's gradient, so the mean over all ranks is the mean over
        replicas). Dividing by step_tokens / (grad_accum * dp_size) therefore leaves the step's gradient equal to
        that of the mean over every labelled token of the step, whatever the micro-batch, accumulation and
        data-parallel size. A step with no labelled token divides 0 by 1."""
        return max(step_tokens, 1) / (grad_accum * self.dp_size)


def layout(engine, sp=None) -> Layout:
    """This rank's layout, read from DeepSpeed after `deepspeed.initialize` (which creates the groups).
    Under Ulysses sequence parallelism (`sp`, memtrain.train.sequence_parallel) a sequence-parallel group
    reads one batch: DeepSpeed reports no data-parallel size under its mpu, so `sp` says which."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    world, rank = dist.get_world_size(), dist.get_rank()
    if sp is not None and sp.data_world != world:
        return Layout(world, 1, sp.data_rank, sp.data_world)
    tp = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
    if tp and tp > 1:
        from deepspeed.utils import groups  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        return Layout(world, groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_rank(),
                      groups.get_data_parallel_world_size(), groups.get_tensor_model_parallel_rank())
    return Layout(world, 1, rank, world)


def check_sharded(model, tp: int) -> None:
    """AutoTP found nothing to shard in an architecture it does not know: say so, never train unsharded."""
    if tp <= 1:
        return
    from deepspeed.module_inject.layers import TensorParallel_Layer  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    if not any(isinstance(m, TensorParallel_Layer) for m in model.modules()):
        raise UserError(f"tensor_parallel.autotp_size: DeepSpeed's AutoTP sharded no layer of {type(model).__name__} "
                        "(an architecture it does not know); remove tensor_parallel or give its partition_config")

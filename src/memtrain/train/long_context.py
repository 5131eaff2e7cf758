"""Apply the long-sequence settings of a recipe to a built model: tiled MLPs, sequence parallelism
and the loss (fused or standard). Returns what deepspeed.initialize needs and the plan's lines."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memtrain.model.build import decoder_layers
from memtrain.model.loss import fused_unsupported, install_loss
from memtrain.model.tiled_mlp import install_tiled_mlp, tiled_mlp_shards
from memtrain.train import sequence_parallel
from memtrain.config.ds_config import zero_stage


@dataclass
class LongContext:
    mpu: Any
    sp: sequence_parallel.SequenceParallel
    loss: str  # the loss actually used: fused | standard
    lines: list[str] = field(default_factory=list)  # for the start-up plan


def describe_loss(recipe, config) -> tuple[str, str]:
    """(loss used, one line for the plan)."""
    if recipe.train.loss == "standard":
        return "standard", "loss: standard (lm_head, then cross-entropy on the full fp32 logits)"
    reason = fused_unsupported(config)
    if reason:
        return "standard", f"loss: standard, not fused: {reason}"
    return "fused", "loss: fused (torch linear_cross_entropy: lm_head + cross-entropy in chunks, no full logits)"


def prepare(model, recipe, stage: int, tp: int = 1) -> LongContext:
    """Call after init_distributed (and any zero.Init), before apply_plan and deepspeed.initialize."""
    sp_size = recipe.parallel.sequence
    seq = recipe.data.seq_len
    lines = []
    shards = tiled_mlp_shards(recipe.activation_checkpointing.tiled_mlp, seq // sp_size, model.config.hidden_size)
    _, layers = decoder_layers(model)
    if install_tiled_mlp(layers, shards):
        tokens = recipe.train.micro_batch_size * seq // sp_size  # one rank's micro-batch, sliced as one row
        lines.append(f"tiled MLP: {shards} slices of {tokens // shards}+ tokens in each of {len(layers)} layers")
    mpu, sp = sequence_parallel.setup(model, sp_size, stage, recipe.train.micro_batch_size, seq)
    if sp.size > 1:
        lines.append(f"sequence parallel: {sp.size} ranks per sequence ({seq // sp.size} tokens each), "
                     f"{sp.data_world} data-parallel group(s); Ulysses attention replaces "
                     f"'{model.config._attn_implementation}' for this process")
    loss, line = describe_loss(recipe, model.config)
    if loss == "fused" and tp > 1:  # AutoTP swaps lm_head for its own layer, which gathers the logits
        loss, line = "standard", (f"loss: standard, not fused: AutoTP (tensor_parallel.autotp_size {tp}) shards "
                                  "lm_head and gathers its logits; the fused loss needs the whole weight")
    elif loss == "fused" and fused_unsupported(model, model.get_output_embeddings()):
        loss, line = "standard", f"loss: standard, not fused: {fused_unsupported(model, model.get_output_embeddings())}"
    install_loss(model, fused=loss == "fused", sp_reduce=sp.reduce_loss if sp.size > 1 else None)
    lines.append(line)
    return LongContext(mpu=mpu, sp=sp, loss=loss, lines=lines)


def check(recipe, ds_config: dict, config, world: int) -> None:
    """Preflight: every reason the recipe's long-sequence settings cannot run, as one UserError line."""
    sp = recipe.parallel.sequence
    sequence_parallel.check(sp, config, recipe.data.seq_len, world, zero_stage(ds_config),
                            getattr(config, "_attn_implementation", None))

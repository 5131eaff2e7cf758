"""Ulysses sequence parallelism (`parallel.sequence: N`): checks, set-up, batch slicing, the loss
across the group, and the data-parallel rank/size that batches and token counts use.

Built on DeepSpeed 0.19.8's ALST classes (deepspeed.runtime.sequence_parallel.ulysses_sp):
`UlyssesSPAttentionHF.register_with_transformers` wraps the model's attention (all-to-all from
sequence slices to head slices and back) and returns the mpu that `deepspeed.initialize` takes.
N consecutive ranks form one sequence-parallel group; ZeRO partitions over all ranks.

Registration replaces `transformers`' attention function (ALL_ATTENTION_FUNCTIONS[sdpa/...]) for
the WHOLE process, with no way back in DeepSpeed 0.19.8: any other model run later in the same
process attends through Ulysses too. memtrain trains one model per process, and sweeps already
run one process per point; a script that builds a second model after a sequence-parallel run must
start a new process.

Batches: every rank of a group reads the same batch (data rank = rank // N, data world = world // N)
and keeps its own 1/N slice of input_ids, position_ids and the pre-shifted labels. This is what
DeepSpeed's `UlyssesSPDataLoaderAdapter` yields, computed locally instead: memtrain's batches are a
pure function of (step, rank), so the adapter's all-gathers of the batch, its per-batch `.item()`
(a host sync every step) and its round trip through host memory are not needed. The tests check
the slices against the adapter's.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from memtrain.errors import UserError
from memtrain.model.build import model_class
from memtrain.model.loss import normalise, shift
from memtrain.model import attention

# attention implementations Ulysses cannot wrap (DeepSpeed rejects them: they need a 4D mask)
_UNSUPPORTED_ATTENTION = ("eager", "paged|eager")
# families whose attention splits its output's last dimension back into heads (`reshape(*shape[:-2], -1)`,
# GPT-2) where Ulysses returns the heads already merged: the output projection gets the wrong shape
_HEADS_MERGED_TOO_EARLY = {"gpt2": "GPT2Attention"}
_REGISTERED: dict = {}  # (size, attention, micro batch, sequence, heads) -> mpu, for this process


def _head_layout(text) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head size) of a text config: what Ulysses' registration fixes."""
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads, \
        getattr(text, "head_dim", None) or text.hidden_size // heads


def check(sp: int, config, seq_len: int, world: int, stage: int, attn_impl: Optional[str]) -> None:
    """Every reason `parallel.sequence: sp` cannot run, as one UserError line, before any worker starts."""
    if sp == 1:
        return
    if world % sp:
        raise UserError(f"parallel.sequence: {sp} does not divide the world size {world}")
    if stage == 0:
        raise UserError(f"parallel.sequence: {sp} needs ZeRO stage 1, 2 or 3 in the DeepSpeed JSON "
                        "(DeepSpeed 0.19.8's Ulysses crashes with stage 0)")
    cls = model_class(config)
    # what transformers picks when the recipe names none: sdpa where the family supports it (Gemma-2 does not)
    attn_impl = attn_impl or ("sdpa" if getattr(cls, "_supports_sdpa", False) else "eager")
    if attn_impl in _UNSUPPORTED_ATTENTION:
        raise UserError(f"parallel.sequence: {sp} needs model.config.attn_implementation sdpa or a flash "
                        f"attention (got {attn_impl}: Ulysses cannot pass its 4D mask)")
    if not hasattr(sys.modules[cls.__module__], "ALL_ATTENTION_FUNCTIONS"):
        raise UserError(f"parallel.sequence: {sp}: {cls.__name__} calls its attention kernel itself, not through "
                        "transformers' attention functions that Ulysses replaces: each rank would attend to its "
                        "own slice only; set parallel.sequence 1")
    if config.model_type in _HEADS_MERGED_TOO_EARLY:
        raise UserError(f"parallel.sequence: {sp}: {_HEADS_MERGED_TOO_EARLY[config.model_type]} splits the "
                        "attention output back into heads, which Ulysses returns merged; set parallel.sequence 1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window, kinds = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    # hybrid layers (linear attention, Mamba, convolutions) mix tokens outside attention: on a rank's slice
    # they would see that slice only
    others = sorted(set(kinds or ()) - {"full_attention", "sliding_attention"}
                    | set(getattr(text, "layers_block_type", None) or ()) - {"attention"})
    if others:
        raise UserError(f"parallel.sequence: {sp}: {cls.__name__} has {', '.join(others)} layers, which mix tokens "
                        "outside the attention Ulysses splits by heads; set parallel.sequence 1")
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk and chunk < seq_len:
        raise UserError(f"parallel.sequence: {sp}: {cls.__name__}'s chunked attention ({chunk} tokens, under "
                        f"data.seq_len {seq_len}) lives in the mask, which Ulysses drops; set parallel.sequence 1")
    if window and window < seq_len and (kinds is None or "sliding_attention" in kinds) \
            and not attn_impl.startswith("flash"):
        raise UserError(f"parallel.sequence: {sp}: {cls.__name__}'s sliding-window attention ({window} tokens, "
                        f"under data.seq_len {seq_len}) lives in the mask, which Ulysses drops under {attn_impl}; "
                        "use model.config.attn_implementation flash_attention_2 (it takes the window as an "
                        "argument) or parallel.sequence 1")
    heads, kv, _ = _head_layout(text)
    if heads % sp:
        raise UserError(f"parallel.sequence: {sp} does not divide num_attention_heads {heads}")
    if kv % sp and sp % kv:
        raise UserError(f"parallel.sequence: {sp} and num_key_value_heads {kv} do not divide one another")
    if seq_len % sp:
        raise UserError(f"parallel.sequence: {sp} does not divide data.seq_len {seq_len}")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in the backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@dataclass
class SequenceParallel:
    """One rank's place in the sequence-parallel layout (size 1: none)."""

    size: int = 1
    rank: int = 0  # within the group
    group: Any = None
    data_rank: int = 0  # which batch this rank reads (the sequence-parallel group's index)
    data_world: int = 1  # how many different batches a step reads
    grad_scale: float = 1.0

    def slice_batch(self, batch) -> dict[str, torch.Tensor]:
        """The forward's inputs for this rank: its slice of the sequence, global positions and the
        labels each position predicts (shifted over the whole sequence before slicing). `batch` is the
        token ids (every token a label, positions 0..S-1), or a dict of input_ids, labels and position_ids
        (chat data: memtrain.model.chat_data)."""
        if isinstance(batch, dict):
            ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        else:
            ids = labels = batch
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(*ids.shape)
        if self.size == 1:
            return {"input_ids": ids, "labels": labels, "position_ids": positions}
        chunk = ids.shape[1] // self.size
        cut = slice(chunk * self.rank, chunk * (self.rank + 1))
        return {"input_ids": ids[:, cut], "position_ids": positions[:, cut], "shift_labels": shift(labels)[:, cut]}

    def reduce_loss(self, total: torch.Tensor, count: torch.Tensor, divisor: Optional[float] = None) -> torch.Tensor:
        """The group's summed loss (every rank's slice), normalised as one rank's would be
        (memtrain.model.loss.normalise): by the step's divisor, which the trainer knows from the data; without
        one, by the group's labelled tokens (one all-reduce), the full sequence's token-weighted mean.
        Differentiable all-gather (as DeepSpeed's tutorial and transformers' deepspeed_sp_compute_loss):
        each rank's backward reaches every rank's slice."""
        totals = torch.stack(dist_nn.all_gather(total, group=self.group)).sum()
        if divisor is None:
            count = count.detach().clone()
            dist.all_reduce(count, group=self.group)
        loss = normalise(totals, count, divisor)
        return _ScaleGrad.apply(loss, self.grad_scale) if self.grad_scale != 1.0 else loss


def setup(model, sp: int, stage: int, micro_batch: int, seq_len: int):
    """Register Ulysses attention for `model` (after init_distributed, before deepspeed.initialize).
    Returns (mpu for deepspeed.initialize or None, SequenceParallel)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp == 1:
        return None, SequenceParallel(data_rank=rank, data_world=world)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    heads = _head_layout(model.config.get_text_config())
    key = (sp, model.config._attn_implementation, micro_batch, seq_len, heads)
    if key not in _REGISTERED:  # the registration is process-wide and can happen once (see above)
        if _REGISTERED:
            raise UserError(f"parallel.sequence: this process already registered Ulysses attention for "
                            f"{next(iter(_REGISTERED))} (size, attention, micro batch, sequence, (heads, key/value "
                            "heads, head size)); start a new process")

        attention.remember(model.config._attn_implementation)  # the planner's profile runs the plain one
        # DeepSpeed reads num_key_value_heads, which multi-head families' configs (GPT-2) do not carry: it
        # gets a copy of the config with it filled in; the model's own config is left as it is
        described = copy.deepcopy(model.config)
        described.get_text_config().num_key_value_heads = heads[1]
        _REGISTERED[key] = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=SimpleNamespace(config=described),
            core_attn_implementation=model.config._attn_implementation,
            sequence_parallel_size=sp, micro_batch_size=micro_batch, seq_length=seq_len, seq_length_is_variable=False)
    mpu = _REGISTERED[key]
    # Every rank of a group backpropagates the same all-gathered loss, so each parameter gradient
    # arrives summed over the group's copies (sp times one copy). ZeRO-3 averages over all ranks,
    # which undoes it; DeepSpeed 0.19.8's ZeRO-1/2 divide by (dp world / sp) instead, so their
    # gradients come out exactly sp times too large (AdamW and clipping hide it, SGD shows it).
    # The tests compare both stages with a one-rank full-sequence run.
    grad_scale = 1.0 / sp if stage in (1, 2) else 1.0
    return mpu, SequenceParallel(size=sp, rank=mpu.get_sequence_parallel_rank(), group=mpu.get_sequence_parallel_group(),
                                 data_rank=rank // sp, data_world=world // sp, grad_scale=grad_scale)

"""The causal-LM loss: `train.loss: fused` (never holds the full fp32 logits) or `standard` (HF's own).

`fused` computes lm_head and cross-entropy together with torch's
`torch.nn.functional.linear_cross_entropy` (torch >= 2.13; on older torch memtrain.model.chunked_ce,
the same algorithm), which walks the tokens in chunks and
never materialises the (tokens x vocab) logits nor their gradient. The call runs inside the
lm_head module's own forward, so under ZeRO-3 DeepSpeed's module hooks gather the partitioned
weight for it exactly as they do for the standard `lm_head(hidden)` (and release it after);
tied embeddings are the same Parameter and need nothing else.

The model's forward is replaced on the instance (the state dict, and with it model checkpoints,
stays the plain HF layout). It returns the summed cross-entropy over the non-ignored shifted labels
divided by the forward's `loss_divisor`: memtrain's trainer passes the optimizer step's labelled
tokens over the micro-steps and data-parallel ranks (memtrain.train.parallel.Layout.loss_divisor), so
every labelled token of a step weighs the same, whatever the micro-batch, accumulation or world
size. Without a divisor it is the mean over the forward's own labelled tokens, HF's `ForCausalLMLoss`
without `num_items_in_batch`. Under sequence parallelism (`sp_reduce`) each rank holds a slice of the
sequence and its pre-shifted `shift_labels`; the group's summed loss is normalised the same way
(without a divisor: by the group's count of labelled tokens, the full-sequence loss). `standard`
without sequence parallelism keeps the model's own forward and loss (`_wrap_hf_loss`).

Where the fused call cannot reproduce the model's own logits (logit soft-capping, logit scaling,
an lm_head that is not a Linear, a router auxiliary loss), `fused` falls back to `standard`;
`fused_unsupported` names the reason, which the start-up plan prints.
"""
from __future__ import annotations

import types
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.model.chunked_ce import linear_cross_entropy_sum

IGNORE_INDEX = -100

# config attributes that change the logits between the decoder and the loss (HF model families)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fused_unsupported(model_or_config, head: Optional[nn.Module] = None) -> Optional[str]:
    """Why `fused` cannot serve this model (None: it can)."""
    config = getattr(model_or_config, "config", model_or_config)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"the model's {name}={value} transforms the logits before the loss"
    if getattr(config, "output_router_logits", False):
        return "the model adds a router auxiliary loss (output_router_logits)"
    if head is not None and type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a Linear"
    return None


def fused_backend() -> str:
    """Which code computes `fused`: "torch" (F.linear_cross_entropy) or "chunked" (memtrain.model.chunked_ce, where
    torch has none). Their working sets differ, so a memory profile of the fused loss is keyed by it."""
    return "torch" if hasattr(F, "linear_cross_entropy") else "chunked"


def _head_forward(self: nn.Linear, hidden: torch.Tensor, shift_labels: Optional[torch.Tensor] = None):
    """lm_head.forward: logits as usual, or with `shift_labels` the summed cross-entropy of the
    labelled tokens, computed in chunks. Runs inside the module call, so ZeRO-3 has gathered weight."""
    if shift_labels is None:
        return F.linear(hidden, self.weight, self.bias)
    if fused_backend() == "chunked":  # torch < 2.13: memtrain's chunked version of the same algorithm
        return linear_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), self.weight, shift_labels.reshape(-1),
                                        bias=self.bias, ignore_index=IGNORE_INDEX)
    return F.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.weight, shift_labels.reshape(-1),
                                  linear_bias=self.bias, reduction="sum", ignore_index=IGNORE_INDEX,
                                  options=torch.nn.LinearCrossEntropyOptions())


def shift(labels: torch.Tensor) -> torch.Tensor:
    """labels -> the label each position predicts (HF ForCausalLMLoss: pad with ignore, drop the first)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def normalise(total: torch.Tensor, count: torch.Tensor, divisor: Optional[float]) -> torch.Tensor:
    """The loss backward takes from a summed token loss: `total / divisor`, the step's divisor (memtrain's trainer:
    memtrain.train.parallel.Layout.loss_divisor, so that the step's gradient is the mean over every labelled token
    of the step); without one (a caller outside the trainer), the mean over this forward's `count` labelled
    tokens, as HF's ForCausalLMLoss."""
    return total / (count.clamp(min=1) if divisor is None else divisor)


def labelled(shift_labels: torch.Tensor) -> torch.Tensor:
    """How many positions have a label (on the labels' device: no host sync)."""
    return (shift_labels != IGNORE_INDEX).sum()


def install_loss(model: nn.Module, fused: bool, sp_reduce: Optional[Callable] = None) -> None:
    """Replace the model's forward so it returns the loss computed the chosen way, normalised by `loss_divisor`
    (a forward keyword: see `normalise`).

    fused: linear_cross_entropy inside lm_head's forward (see module docstring).
    sp_reduce(local_sum, local_count, divisor) -> loss: the sequence-parallel group's summed loss, normalised;
    None: one rank holds the whole sequence. With neither, the model's own forward computes HF's loss (logit
    transforms and router losses included) and its mean becomes a sum again (times the labelled count) to be
    normalised the same way; without a divisor its output is HF's, untouched."""
    if not fused and sp_reduce is None:
        _wrap_hf_loss(model)
        return
    head = model.get_output_embeddings()
    if fused:
        head.forward = types.MethodType(_head_forward, head)
    base = model.base_model

    def forward(self, input_ids=None, labels=None, position_ids=None, shift_labels=None, loss_divisor=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput  # noqa: PLC0415 transformers: heavy, imported only when this runs

        hidden = base(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        if shift_labels is None:
            shift_labels = shift(labels)
        if fused:
            total = head(hidden, shift_labels=shift_labels)
        else:  # HF's standard: full logits, upcast to fp32 (as ForCausalLMLoss does)
            logits = head(hidden).float()
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
        count = labelled(shift_labels)
        if sp_reduce is not None:
            return CausalLMOutput(loss=sp_reduce(total, count, loss_divisor))
        # divide after the fused call: its backward scales both the input and the weight gradient
        return CausalLMOutput(loss=normalise(total, count, loss_divisor))

    model.forward = types.MethodType(forward, model)


def _wrap_hf_loss(model: nn.Module) -> None:
    """The model's own forward and loss, normalised by `loss_divisor` when one is given. HF's mean times the
    labelled count is the sum (a forward with no labelled token contributes 0, not HF's 0/0). The divisor is not
    passed to HF as its `num_items_in_batch`: HF hands its keywords down to every decoder layer, where compiled
    layers would recompile for each new value."""
    own = model.forward

    def forward(self, *args, labels=None, loss_divisor=None, **kwargs):
        out = own(*args, labels=labels, **kwargs)
        if loss_divisor is not None and labels is not None:
            count = labelled(shift(labels))
            total = torch.where(count > 0, out.loss * count, 0.0)
            out.loss = normalise(total, count, loss_divisor)
        return out

    model.forward = types.MethodType(forward, model)

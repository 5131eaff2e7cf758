"""lm_head + cross-entropy in chunks of tokens, for torch < 2.13 (which lacks `F.linear_cross_entropy`).

`train.loss: fused` calls torch's own `torch.nn.functional.linear_cross_entropy` wherever it exists
(torch >= 2.13, memtrain's pin). GPU images often ship an older torch (the lent H100's has 2.11), and
without this module the fused loss, memtrain's default, would fail there at the first step. This is
the same algorithm as torch's chunked path (and Liger's fused linear cross-entropy): the forward walks
the tokens in chunks, computes each chunk's fp32 logits, its loss and at once its gradients with
respect to the hidden states and lm_head's weight; the backward only scales those by the incoming
gradient. The full (tokens x vocab) logits never exist, and neither does lm_head's weight need to be
kept for the backward: under ZeRO-3 it is released after the forward like any other.

Memory: one chunk's fp32 logits and its softmax (2 x chunk x vocab x 4 B), plus the input's gradient
(tokens x hidden) and the weight's fp32 gradient (vocab x hidden x 4 B), held from the forward to the
backward, as torch's chunked path holds them (memtrain.memory.profile counts them as a transient).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

CHUNK_PER_HIDDEN = 2  # tokens per chunk = 2 x hidden size: a chunk's logits about twice lm_head's weight in bytes


def chunk_tokens(hidden_size: int) -> int:
    return max(1, CHUNK_PER_HIDDEN * hidden_size)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over labelled tokens of cross_entropy(hidden @ weight.T + bias, labels); gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                ignore_index: int, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        grad_input = torch.empty_like(hidden) if need_input else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = F.linear(h, weight, bias).float()
            keep = y != ignore_index
            target = torch.where(keep, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += torch.where(keep, lse - picked, 0.0).sum()
            # d(loss)/d(logits) = softmax - one_hot(label) on labelled rows, 0 on ignored ones
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, target[:, None], torch.full_like(picked[:, None], -1.0))
            grad.mul_(keep[:, None])
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(hidden.dtype)
            if need_input:
                grad_input[start:start + chunk] = grad @ weight
            if need_weight:
                grad_weight += (grad.t() @ h).float()  # each chunk's product in the input's dtype, summed in fp32
        # held on ctx, not saved for backward: they are the backward's results, not inputs it needs, as in torch's
        # chunked path (so saved-tensor hooks, memtrain's ActivationMeter among them, see the same on either torch)
        ctx.grads = (grad_input, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError("chunked linear cross-entropy: its gradients were made in the forward and used by the "
                               "first backward; a second backward through the same graph is not supported")
        grad_input, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # freed with this backward
        weight_dtype, bias_dtype = ctx.dtypes
        scale = grad_total.float()
        return (None if grad_input is None else grad_input * scale.to(grad_input.dtype),
                None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
                None if grad_bias is None else (grad_bias * scale).to(bias_dtype),
                None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                             chunk: Optional[int] = None) -> torch.Tensor:
    """F.linear_cross_entropy(hidden, weight, labels, linear_bias=bias, reduction="sum", ignore_index=...) in chunks."""
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index,
                                           chunk or chunk_tokens(hidden.shape[-1]))

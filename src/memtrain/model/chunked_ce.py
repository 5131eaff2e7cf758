"""lm_head + cross-entropy in chunks of tokens, for torch < 2.13 (which lacks `F.linear_cross_entropy`).

`train.loss: fused` calls torch's own `torch.nn.functional.linear_cross_entropy` wherever it exists
(torch >= 2.13, memtrain's pin). GPU images often ship an older torch (the lent H100's has 2.11), and
without this module the fused loss, memtrain's default, would fail there at the first step. This is
the same algorithm as torch's chunked path (and Liger's fused linear cross-entropy): the forward walks
the tokens in chunks, computes each chunk's fp32 logits, its loss and at once its gradients with
respect to the hidden states and lm_head's weight; the backward only scales those by the incoming
gradient. The full (tokens x vocab) logits never exist, and neither does lm_head's weight need to be
kept for the backward: under ZeRO-3 it is released after the forward like any other.

Memory: one chunk's fp32 logits, worked in place into its gradient (chunk x vocab x 4 B), plus the input's gradient
(tokens x hidden) and the weight's fp32 gradient (vocab x hidden x 4 B), held from the forward to the
backward, as torch's chunked path holds them (memtrain.memory.profile counts them as a transient).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def chunk_tokens(hidden_size: int) -> int:
    """Tokens per chunk: half the hidden size, so a chunk's fp32 logits take half of an fp32 lm_head weight's bytes
    (TinyLlama: 1,024 tokens, 131 MB at a 32,000 vocabulary), and the matmuls stay large enough to run at speed."""
    return max(1, hidden_size // 2)


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
            keep = y != ignore_index
            target = torch.where(keep, y, 0)
            # one (chunk x vocab) fp32 buffer, worked in place: logits -> exp(logits - max) -> softmax -> gradient
            work = F.linear(h, weight, bias).float()
            picked = work.gather(1, target[:, None])
            top = work.amax(dim=-1, keepdim=True)
            norm = work.sub_(top).exp_().sum(dim=-1, keepdim=True)
            total += torch.where(keep[:, None], norm.log() + top - picked, 0.0).sum()
            # d(loss)/d(logits) = softmax - one_hot(label) on labelled rows, 0 on ignored ones
            grad = work.div_(norm)
            grad.scatter_add_(1, target[:, None], torch.full_like(picked, -1.0))
            grad.mul_(keep[:, None])
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(hidden.dtype)
            if need_input:
                grad_input[start:start + chunk] = grad @ weight  # (not out=: autocast refuses it)
            if need_weight:
                if grad.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad.t(), h)
                else:  # the product in the input's dtype (bf16: half an fp32 weight's bytes), summed in fp32
                    grad_weight += grad.t() @ h
            del work, grad  # before the next chunk's logits: one chunk alive at a time
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

"""Held-out loss: a no-grad forward of the eval rows under the training engine, token-weighted over every data rank.

The forward is the training one: ZeRO-3 gathers each layer's parameters as in training, AutoTP and Ulysses split
the work as in training, and the loss is the training loss summed (loss_divisor 1). It runs with dropout off
(`engine.eval()`) and without autograd, so nothing is saved for a backward and nothing is recomputed; the
training RNG streams draw nothing, so an eval leaves the training that follows unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import deepspeed.comm as dist

from memtrain.model.data import as_batch, to_device
from memtrain.model.eval_data import labelled, micro_rows


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per labelled token (nats)
    tokens: int  # labelled tokens evaluated, over every data rank

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows float64 past ~709

    def metrics(self) -> dict[str, float]:
        """TensorBoard's tags (the same names `make report` reads)."""
        return {"eval/loss": self.loss, "eval/perplexity": self.perplexity}


def evaluate(engine, data, sp, layout, batches: int, micro_batch: int) -> EvalResult:
    """`batches` eval micro-batches on this data rank (memtrain.model.eval_data.micro_rows), then one all-reduce of
    the summed loss and the labelled count; the one host read is the result (once per eval, not per step)."""
    device = engine.device  # the reduction's tensor lives where the collective runs (NCCL: the GPU)
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    was_training = engine.module.training
    engine.eval()
    try:
        with torch.no_grad():
            for index in range(batches):
                batch = as_batch(data.rows(micro_rows(index, layout.dp_rank, layout.dp_size, micro_batch))).inputs
                count += labelled(batch)  # every rank of a TP/SP group counts its replica's rows, as it sums them
                total += engine(**sp.slice_batch(to_device(batch, device)), loss_divisor=1.0).loss.double()
    finally:
        engine.train(was_training)
    stats = torch.stack([total, torch.tensor(float(count), device=device, dtype=torch.float64)])
    dist.all_reduce(stats)  # a TP/SP group's ranks each add their replica's sum and count: the ratio is unchanged
    summed, counted = stats.tolist()
    return EvalResult(summed / counted, round(counted * layout.dp_size / layout.world))

"""Which packed row each (step, micro-step, data rank) reads: a pure function of the position, so a resumed run
reads exactly the rows an uninterrupted one would, and every rank can name the rows every other rank reads.

Rows are read in a seeded permutation per epoch. Global sample g = ((step * grad_accum + micro) * world + rank)
* micro_batch + i, so the rows of one optimizer step, over all its micro-steps and data ranks, are the
contiguous range [step * grad_accum * world * micro_batch, + grad_accum * world * micro_batch): what
`step_rows` returns, and what the step's labelled-token count (memtrain.train.parallel.Layout.loss_divisor) sums.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False  # shared by every caller through the cache
    return order


def rows(n: int, seed: int, first: int, count: int) -> np.ndarray:
    """The row indices of global samples first .. first + count - 1 of an n-row dataset."""
    epochs, positions = np.divmod(np.arange(first, first + count), n)
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        out[where] = _permutation(n, seed, int(epoch))[positions[where]]
    return out


def micro_rows(n: int, seed: int, step: int, micro: int, rank: int, world: int, micro_batch: int,
               grad_accum: int) -> np.ndarray:
    """The rows `rank` (of `world` data ranks) reads at (step, micro)."""
    return rows(n, seed, ((step * grad_accum + micro) * world + rank) * micro_batch, micro_batch)


def step_rows(n: int, seed: int, step: int, world: int, micro_batch: int, grad_accum: int) -> np.ndarray:
    """Every row that `step` reads, on all its micro-steps and all `world` data ranks."""
    per_step = grad_accum * world * micro_batch
    return rows(n, seed, step * per_step, per_step)


def resumed_shift(resumed_at: int, samples: int, per_step: int) -> int | None:
    """The data position of a resumed segment, as a shift of the step: a run that resumes after `samples` global
    samples at step `resumed_at`, reading `per_step` samples a step from then on, reads at step s the samples
    [samples + (s - resumed_at) * per_step, + per_step), which are the rows `step_rows`/`micro_rows` give for step
    s + shift. None where `samples` is not a whole number of the new steps (no step of the order starts there).
    A straight run, and a resume that keeps per_step, has shift 0: its rows are unchanged."""
    if samples % per_step:
        return None
    return samples // per_step - resumed_at

"""Held-out evaluation data: which rows an eval pass reads, on which data rank, and how many labels they hold.

The eval rows are cut like the training rows (same tokenizer, seq_len and format) from data.eval_paths' files, or
from the documents data.eval_fraction holds out of the training corpus (memtrain.model.sample_view: no eval document
is ever in a training row), and an eval pass reads the first rows in order: the same rows at every eval of a run and of its
resumed segments, so
eval losses compare across steps, runs and sweep points.
"""
from __future__ import annotations

import numpy as np

from memtrain.config.recipe import DataSection, TrainSection
from memtrain.errors import UserError
from memtrain.model.loss import IGNORE_INDEX
from memtrain.model.data import prepare_data


def has_eval_data(data: DataSection) -> bool:
    """Whether the recipe names held-out data."""
    return bool(data.eval_paths) or data.eval_fraction > 0


def check_settings(data: DataSection, train: TrainSection) -> None:
    """Eval settings need eval data; eval data needs text to train on (one line each)."""
    if data.eval_paths and data.eval_fraction:
        raise UserError("data.eval_paths and data.eval_fraction: both set; held-out data comes from one of them")
    if data.eval_fraction and data.format != "text":
        raise UserError(f"data.eval_fraction: splits text documents; data.format '{data.format}' rows are held out "
                        "by naming their files in data.eval_paths")
    if has_eval_data(data):
        if data.random_tokens:
            key = "data.eval_paths" if data.eval_paths else "data.eval_fraction"
            raise UserError(f"{key}: data.random_tokens trains on random ids; a held-out loss on text "
                            "measures nothing about them (remove one of the two)")
        return
    # set to something, not merely present: a resumed run's saved recipe holds every key, defaults included
    given = [f"train.{k}" for k in ("eval_every", "eval_batches")
             if getattr(train, k) != TrainSection.model_fields[k].default]
    if given:
        raise UserError(f"{given[0]}: set, but there is no held-out data to evaluate; name it with data.eval_paths "
                        "or hold out documents with data.eval_fraction")


def eval_section(data: DataSection) -> DataSection:
    """The data section that packs the eval files: the training section with eval_paths as its paths, read whole
    (data.max_bytes caps the training text only: a held-out set is small and is read entire)."""
    return data.model_copy(update={"paths": list(data.eval_paths), "eval_paths": [], "sources": [], "max_bytes": None})


def prepare_eval_data(data: DataSection, seed: int, build: bool = True):
    """The eval rows (PackedData or PackedChat, as for training), or None without eval data."""
    if not has_eval_data(data):
        return None

    if data.eval_paths:
        return prepare_data(eval_section(data), seed, build=build)
    return prepare_data(data, seed, build=build, split="eval")  # data.eval_fraction's documents


def batches_per_rank(rows: int, asked: int, dp_size: int, micro_batch: int, grad_accum: int,
                     source: str = "data.eval_paths") -> int:
    """Eval micro-batches each data rank reads: train.eval_batches global batches (Megatron's eval-iters: an
    optimizer step's rows, micro-batch x accumulation x data ranks, each), or fewer when the eval data holds fewer
    rows (every rank reads the same number, so the ranks meet in the reduction). So an eval reads the same rows
    on any world size that keeps the global batch (a resume on another world size does). None fit: one line."""
    fit = rows // (dp_size * micro_batch)
    if fit == 0:
        raise UserError(f"{source}: the eval data packs into {rows} row(s), fewer than one eval batch "
                        f"({dp_size} data rank(s) x micro-batch {micro_batch}); add held-out text")
    return min(asked * grad_accum, fit)


def micro_rows(index: int, dp_rank: int, dp_size: int, micro_batch: int) -> np.ndarray:
    """The rows data rank `dp_rank` reads in eval micro-batch `index`: consecutive rows, ranks interleaved by
    micro-batch, so the pass reads rows 0 .. batches * dp_size * micro_batch - 1 once each."""
    first = (index * dp_size + dp_rank) * micro_batch
    return np.arange(first, first + micro_batch)


def labelled(batch) -> int:
    """Positions the loss trains on in a host batch (a row's last position predicts nothing): every position but
    the last for text rows, the labelled next tokens for chat rows. Counted on the host: no device sync."""
    if isinstance(batch, dict):
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return batch.shape[0] * (batch.shape[1] - 1)


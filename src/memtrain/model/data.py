"""A run's inputs: text rows cut from the token store (memtrain.model.token_store, memtrain.model.sample_view),
split into train and eval documents; chat rows from the chat store (memtrain.model.chat_store,
memtrain.model.chat_data); seeded random tokens.

Batches are a pure function of (step, micro-step, rank), so a resumed run reads exactly
the samples an uninterrupted run would have read: no sampler state to save.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from memtrain.errors import UserError
from memtrain.config.recipe import DataSection
from memtrain.model import chat_data, order
from memtrain.model.blend import BlendView
from memtrain.model.corpus_reader import builder_for, resolve_files, source_sections  # noqa: F401 (builder_for: preflight)
from memtrain.model.sample_view import SampleView, split_view
from memtrain.model.token_store import open_store
from memtrain.model.tokenizer import build_tokenizer, save_tokenizer  # noqa: F401 (save_tokenizer: its old home)
from memtrain.model.chat_store import open_chat_samples


# --------------------------------------------------------------------------- packed data

@dataclass
class PackedData:
    """Token sequences of length seq_len, shape [num_sequences, seq_len]: an array, or a SampleView of the store."""

    sequences: np.ndarray | SampleView | BlendView
    vocab_size: int
    seed: int

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        """The micro-batch that `rank` trains on at (step, micro). Pure function: resume-exact."""
        rows = order.micro_rows(len(self.sequences), self.seed, step, micro, rank, world, micro_batch, grad_accum)
        return self.rows(rows)

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """Rows `indices` in the given order as int64 [len(indices), seq_len] (eval reads its rows in order)."""
        return torch.from_numpy(self.sequences[np.asarray(indices, dtype=np.int64)].astype(np.int64))

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """Tokens with a label in all of `step`'s micro-batches on all `world` data ranks: every position of a
        row but the last (it has no next token)."""
        return grad_accum * world * micro_batch * (self.sequences.shape[1] - 1)


@dataclass
class RandomTokens:
    """`data.random_tokens`: seeded random ids in [0, vocab_size), the same interface as PackedData.
    A batch is a pure function of its position, like PackedData's, so resume stays exact."""

    vocab_size: int
    seq_len: int
    seed: int

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        first = ((step * grad_accum + micro) * world + rank) * micro_batch
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + first)
        return torch.randint(0, self.vocab_size, (micro_batch, self.seq_len), generator=generator)

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """As PackedData's: every position of a row but the last."""
        return grad_accum * world * micro_batch * (self.seq_len - 1)


@dataclass(frozen=True)
class Batch:
    """One micro-batch of any data kind: the forward's inputs (packed text and random tokens: the ids, every token a
    label; chat rows: a dict of input_ids, labels and position_ids) and the real tokens it holds (not padding: what
    tokens/s and MFU count)."""

    inputs: Any  # torch.Tensor | dict[str, torch.Tensor]
    tokens: int


def as_batch(rows) -> Batch:
    """What a data kind's `batch()` or `rows()` returns (ids, or chat rows with their "tokens" count) as a Batch."""
    if isinstance(rows, dict):
        inputs = dict(rows)
        return Batch(inputs, int(inputs.pop("tokens")))
    return Batch(rows, rows.numel())


def to_device(batch, device: torch.device):
    """Host batch (a tensor, or a dict of them) -> device without blocking the host: pinned memory and a
    non-blocking copy on the current stream (ordered before the forward that reads it; the caching host
    allocator keeps the pinned buffer alive until the copy is done)."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def prepare_data(cfg: DataSection, seed: int, build: bool = True, split: Literal["train", "eval"] = "train"):
    """The run's rows: PackedData over the token store (built first when missing; `build=False` only opens it), the
    documents of `split` (data.eval_fraction), or PackedChat for data.format chat / instruction (their store,
    memtrain.model.chat_store, packed into rows of seq_len: memtrain.model.chat_data; train only)."""
    files = resolve_files(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.format != "text":
        chat_data.check_template(tokenizer, cfg)  # the template the store renders with, and its key reads
        samples = open_chat_samples(files, cfg, tokenizer, build)
        return chat_data.PackedChat(samples, cfg, tokenizer.vocab_size, seed)
    if cfg.sources:
        return PackedData(_blend(cfg, tokenizer, seed, build, split), tokenizer.vocab_size, seed)
    store = open_store(files, cfg, tokenizer, build)
    return PackedData(split_view(store, cfg, split, len(files)), tokenizer.vocab_size, seed)


def _blend(cfg: DataSection, tokenizer, seed: int, build: bool, split: str) -> BlendView:
    """data.sources: each source's store and `split` rows, mixed by weight for train, each eval row once for eval."""
    views = []
    for i, source in enumerate(source_sections(cfg)):
        files = resolve_files(source)
        try:
            views.append(split_view(open_store(files, source, tokenizer, build), source, split, len(files)))
        except UserError as e:
            raise UserError(f"data.sources[{i}]: {e}") from None
    weights = [s.weight for s in cfg.sources] if split == "train" else [len(v) for v in views]
    return BlendView(views, weights, seed)


def blend_plan_line(data: PackedData, run_rows: int) -> str:
    """One line: each source's tokens, its share of the training rows and the epochs of it `run_rows` rows take."""
    parts = [f"source {i}: {p['tokens'] / 1e6:.1f}M tokens, {100 * p['share']:.1f}% of rows, {p['epochs']:.2f} epochs"
             for i, p in enumerate(data.sequences.plan(run_rows))]
    return f"memtrain: data blend over {run_rows} rows: " + "; ".join(parts)

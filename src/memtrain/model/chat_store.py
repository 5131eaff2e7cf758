"""The chat store: chat and instruction rows rendered by the chat template and tokenized once, in file order, by
worker processes with bounded memory, into a token store (memtrain.model.token_store: one builder, a killed build
continues) with each token's assistant mask beside its id; keyed by the files, the tokenizer, the chat template,
the columns read and the mask rule, not by seq_len (memtrain.model.chat_data packs the samples into rows when a run
opens them).

A store is a directory `<cache_dir>/chat-<key>/`:
  tokens.bin    every stored sample's ids, end to end (uint16 when the vocabulary fits, else uint32)
  offsets.bin   int64 [samples + 1]: sample i is tokens[offsets[i]:offsets[i + 1]], whatever its length
  mask.bin      uint8 per token: 1 on the assistant's tokens (the labels)
  trained.bin   uint32 per sample: its assistant tokens
  manifest.json written last: counts, the rows skipped by reason (documents: the samples stored)
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import numpy as np

from memtrain.config.recipe import DataSection
from memtrain.errors import UserError
from memtrain.model.chat_data import ChatSamples, encode_row
from memtrain.model.chat_rows import columns
from memtrain.model.corpus_reader import builder_for, positioned_records
from memtrain.model.token_store import (FORMAT, MANIFEST, Contents, build_once, default_workers, files_hash,
                                        memmap_file, store_dtype, write_store)

MASK_RULE = "assistant-tokens-1"  # which tokens the loss trains on: bump when that changes, and old stores go
FILES = ("tokens.bin", "offsets.bin", "mask.bin", "trained.bin")
COLUMN_KEYS = ("format", "messages_key", "prompt_key", "response_key", "input_key", "system_key", "tools_key")


def chat_store_key(files: list[Path], cfg: DataSection, tokenizer) -> str:
    """What a chat store's ids and masks depend on: each file (resolved path, size, mtime), the tokenizer (name and
    fingerprint), its chat template (after data.chat_template), the columns read and the mask rule; not seq_len,
    data.truncate, micro-batch or world size."""
    h = files_hash(files)
    read = {key: getattr(cfg, key) for key in COLUMN_KEYS} | {"sharegpt": cfg.sharegpt.model_dump(mode="json")}
    h.update(json.dumps([FORMAT, MASK_RULE, tokenizer.name, tokenizer.fingerprint,
                         str(getattr(tokenizer.hf, "chat_template", None)), read], sort_keys=True).encode())
    return h.hexdigest()[:20]


def chat_store_path(files: list[Path], cfg: DataSection, tokenizer) -> Path:
    """Where the rows' store is (or will be)."""
    return Path(cfg.cache_dir) / f"chat-{chat_store_key(files, cfg, tokenizer)}"


def open_chat_samples(files: list[Path], cfg: DataSection, tokenizer, build: bool = True) -> ChatSamples:
    """The rows' store, built first when missing (`build=False`: FileNotFoundError instead), memory-mapped. The
    tokenizer's chat template is the one to render with (memtrain.model.chat_data.check_template set it)."""
    for f in files:
        if builder_for(f) == "text":
            raise UserError(f"data.paths: {f}: data.format '{cfg.format}' reads JSON lines or parquet, not "
                            f"{f.suffix or 'extensionless'} files")
    target = chat_store_path(files, cfg, tokenizer)
    workers = cfg.workers or default_workers()
    build_once(target, build, lambda tmp: write_store(tmp, files, cfg, tokenizer, workers,
                                                       chat_contents(files, cfg, tokenizer)))
    manifest = json.loads((target / MANIFEST).read_text())
    return ChatSamples(memmap_file(target / "tokens.bin", np.dtype(manifest["dtype"])),
                       memmap_file(target / "mask.bin", np.uint8), memmap_file(target / "offsets.bin", np.int64),
                       memmap_file(target / "trained.bin", np.uint32), manifest["skipped"], tokenizer.eos_token_id)


def chat_contents(files: list[Path], cfg: DataSection, tokenizer) -> Contents:
    """The rows of `files`, streamed, and how a worker renders a chunk of them."""
    required, optional = columns(cfg)
    names = {cfg.messages_key: "messages_key", cfg.prompt_key: "prompt_key", cfg.response_key: "response_key"}
    keys = {column: names[column] for column in required}

    def items(position):
        return ((row, len(json.dumps(row, ensure_ascii=False, default=str)), after)
                for row, after in positioned_records(files, keys, optional, position))

    return Contents("chat", FILES, items, functools.partial(encode_rows, tokenizer, cfg, store_dtype(tokenizer)))


def encode_rows(tokenizer, cfg: DataSection, dtype, rows: list[dict]):
    """A chunk of rows as the store's arrays: (ids end to end, tokens per sample, [mask, trained], skipped rows by
    reason)."""
    samples, skipped = [], Counter()
    for row in rows:
        sample, why = encode_row(tokenizer.hf, row, cfg)
        if sample is None:
            skipped[why] += 1
        else:
            samples.append(sample)
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    ids = np.concatenate([ids for ids, _ in samples]) if samples else np.zeros(0, dtype=np.int64)
    if len(ids) and int(ids.max()) > np.iinfo(dtype).max:
        raise UserError(f"data.tokenizer: id {int(ids.max())} exceeds the tokenizer's vocabulary size "
                        f"{tokenizer.vocab_size}")
    mask = np.concatenate([m for _, m in samples]).astype(np.uint8) if samples else np.zeros(0, dtype=np.uint8)
    trained = np.array([int(m.sum()) for _, m in samples], dtype=np.uint32)
    return ids.astype(dtype), lengths, [mask, trained], dict(skipped)

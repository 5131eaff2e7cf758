"""Chat and instruction data: rendered by the chat template, loss on the assistant's tokens only, packed whole.

Rows become messages (and tools) in memtrain.model.chat_rows. Each sample is rendered with the tokenizer's chat
template (`data.chat_template` replaces it); its labels are -100 everywhere but on the assistant's tokens. Where
the template marks them ({% generation %}), transformers' `return_assistant_tokens_mask` gives them; else each
assistant turn's tokens are the difference between the conversation rendered up to the turn with the generation
prompt and with the turn. Samples are packed whole, first fit in file order, into rows of `data.seq_len`; position
ids restart at 0 for each sample, so transformers' attention keeps samples apart (it reads packed sequences from
the positions), and a row's unused tail is padding with label -100. A sample that cannot be used (no assistant
turn, malformed messages, a template that raises or does not render the conversation as a prefix of its
continuation, longer than a row without `data.truncate`) is counted by reason and reported in one line, never
dropped silently; `data.truncate` keeps an over-long sample's first `data.seq_len` tokens and counts it.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from memtrain.config.recipe import DataSection
from memtrain.errors import UserError
from memtrain.model import order
from memtrain.model.chat_rows import row_messages

IGNORE = -100
GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")


def template_text(cfg: DataSection) -> str:
    """data.chat_template's Jinja text; UserError (one line) for a file that cannot be read."""
    path = Path(cfg.chat_template)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"data.chat_template: cannot read '{path}' ({getattr(e, 'strerror', None) or e}); expected a "
                        "Jinja chat template file") from None


def check_template(tokenizer, cfg: DataSection) -> None:
    """One line when the format needs a chat template the tokenizer lacks; data.chat_template replaces the
    tokenizer's own (so the data cache's key, which reads the template, follows it)."""
    if cfg.chat_template and tokenizer.hf is not None:
        tokenizer.hf.chat_template = template_text(cfg)
    template = getattr(tokenizer.hf, "chat_template", None)
    if not template:
        what = "memtrain's byte tokenizer" if cfg.tokenizer in ("byte", None) else f"the tokenizer in {cfg.tokenizer}"
        raise UserError(f"data.format: '{cfg.format}' renders samples with the tokenizer's chat template, and "
                        f"{what} has none; set data.tokenizer to a local tokenizer directory whose "
                        "tokenizer_config.json has a chat_template")


def end_of_turn_id(tok):
    """The special token the chat template closes an assistant turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>,
    Gemma's <end_of_turn>): the first special token it renders after the assistant's words; None when it renders
    none, or cannot render a user and an assistant turn."""
    mark = "memtrain-end-of-turn-probe"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}],
                                       tokenize=False)
    except Exception:  # a template's own error (jinja's TemplateError, or what its raise_exception raises)
        return None
    if mark not in text:
        return None
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    tail = tok(text[text.rindex(mark) + len(mark):], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if i in special), None)


class TemplateFailure(Exception):
    """The chat template raised on a sample; the message is the first line of its error."""


def has_generation_marks(template) -> bool:
    """Whether the template marks what the assistant generates ({% generation %}), so that transformers' own
    `return_assistant_tokens_mask` gives the labels."""
    return bool(template) and GENERATION_MARK.search(template) is not None


def _render(tok, messages: list[dict], tools, prompt: bool = False, masks: bool = False) -> dict:
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=prompt,
                                       return_dict=True, return_assistant_tokens_mask=masks)
    except Exception as e:  # the template's own error (jinja's, or what its raise_exception raises): the row's
        lines = str(e).strip().splitlines()
        raise TemplateFailure(lines[0] if lines else type(e).__name__) from None


def encode_sample(tok, messages: list[dict], tools=None):
    """(token ids, mask of the assistant's tokens), or None when the template (without generation marks) does not
    render each assistant turn as an extension of the conversation before it. TemplateFailure when it raises."""
    if has_generation_marks(tok.chat_template):
        out = _render(tok, messages, tools, masks=True)
        return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=bool)
    ids = list(_render(tok, messages, tools)["input_ids"])
    mask = np.zeros(len(ids), dtype=bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = list(_render(tok, messages[:i], tools, prompt=True)["input_ids"])
        upto = list(_render(tok, messages[:i + 1], tools)["input_ids"])
        if upto[:len(before)] != before or ids[:len(upto)] != upto:
            return None
        mask[len(before):len(upto)] = True
    return np.asarray(ids, dtype=np.int64), mask


def _encoded(tok, row: dict, cfg: DataSection):
    """(sample, None, truncated?) or (None, why skipped, False) for one row."""
    messages, tools, why = row_messages(row, cfg)
    if messages is None:
        return None, why, False
    try:
        encoded = encode_sample(tok, messages, tools)
    except TemplateFailure as e:
        return None, f"template error: {e}", False
    if encoded is None:
        return None, "template not prefix-stable", False
    truncated = len(encoded[0]) > cfg.seq_len
    if truncated and not cfg.truncate:
        return None, "longer than data.seq_len", False
    ids, mask = encoded[0][:cfg.seq_len], encoded[1][:cfg.seq_len]
    if not mask.any():
        return None, "no assistant token" + (" within data.seq_len" if truncated else " in the rendering"), False
    return (ids, mask), None, truncated


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int):
    """Whole samples into rows, first fit in order: (ids, labels, positions) [rows, seq_len], and each row's real
    (not padding) token count [rows]."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    free: list[int] = []
    for sample in samples:
        n = len(sample[0])
        slot = next((r for r, left in enumerate(free) if left >= n), None)
        if slot is None:
            rows.append([]), free.append(seq_len)
            slot = len(rows) - 1
        rows[slot].append(sample)
        free[slot] -= n
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), seq_len), dtype=np.int64)
    real = np.array([seq_len - left for left in free], dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for x, mask in row:
            ids[r, at:at + len(x)] = x
            labels[r, at:at + len(x)] = np.where(mask, x, IGNORE)
            positions[r, at:at + len(x)] = np.arange(len(x))
            at += len(x)
        positions[r, at:] = np.arange(seq_len - at)  # the padding: a segment of its own
    return ids, labels, positions, real


def build(texts_rows: list[dict], tokenizer, cfg: DataSection) -> tuple[tuple[np.ndarray, ...], dict]:
    """Packed arrays and the report of what was used and skipped."""
    tok = tokenizer.hf
    samples, skipped, truncated = [], Counter(), 0
    for row in texts_rows:
        sample, why, cut = _encoded(tok, row, cfg)
        if sample is None:
            skipped[why] += 1
        else:
            samples.append(sample)
            truncated += cut
    if not samples:
        raise UserError(f"data.paths: no usable {cfg.format} sample in {len(texts_rows)} row(s) "
                        f"({_skipped_text(skipped)})")
    arrays = pack(samples, cfg.seq_len, tokenizer.eos_token_id)
    real = int(sum(len(x) for x, _ in samples))
    report = {"samples": len(samples), "rows": len(arrays[0]), "real_tokens": real,
              "trained_tokens": int(sum(m.sum() for _, m in samples)), "skipped": dict(skipped), "truncated": truncated}
    return arrays, report


def _skipped_text(skipped: dict) -> str:
    return ", ".join(f"{n:,} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])) or "none skipped"


def report_line(report: dict, cfg: DataSection) -> str:
    """The plan line: what was packed, how full the rows are, what was skipped and why."""
    total = report["rows"] * cfg.seq_len
    skipped = sum(report["skipped"].values())
    return (f"data: {cfg.format}, {report['samples']:,} samples in {report['rows']:,} rows of {cfg.seq_len:,} tokens "
            f"({100 * report['real_tokens'] / total:.0f}% real, {100 * report['trained_tokens'] / total:.0f}% "
            f"trained on); skipped {skipped:,} of {report['samples'] + skipped:,}"
            + (f": {_skipped_text(report['skipped'])}" if skipped else "")
            + (f"; truncated {report['truncated']:,} to data.seq_len" if report.get("truncated") else ""))


@dataclass
class PackedChat:
    """Packed chat/instruction rows with their labels and positions; the same batch interface as PackedData
    (a pure function of the position: resume-exact), returning the forward's inputs and the real-token count.

    Saved as one directory of .npy files in the narrowest dtypes that hold them and loaded memory-mapped: every
    rank of a node reads the same page-cache copy, and a batch converts only its own rows to int64."""

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    real: np.ndarray  # per row: tokens that are not padding (what tokens/s and MFU count)
    vocab_size: int
    seed: int
    report: dict
    labelled: Optional[np.ndarray] = None  # per row: positions the loss trains on (label of the next token set)

    def __post_init__(self) -> None:
        if self.labelled is None:
            self.labelled = _labelled(self.labels)

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> dict:
        return self.rows(order.micro_rows(len(self.ids), self.seed, step, micro, rank, world, micro_batch, grad_accum))

    def rows(self, rows: np.ndarray) -> dict:
        """Rows by index: the forward's inputs and their real-token count (eval reads its rows in order)."""
        wide = lambda a: torch.from_numpy(np.asarray(a[rows], dtype=np.int64))  # noqa: E731 (only these rows)
        return {"input_ids": wide(self.ids), "labels": wide(self.labels), "position_ids": wide(self.positions),
                "tokens": int(self.real[rows].sum())}

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """Tokens with a label in all of `step`'s micro-batches on all `world` data ranks (each rank can name every
        rank's rows: memtrain.model.order), counted as the loss counts them: position t is trained on when
        token t + 1 is labelled."""
        return int(self.labelled[order.step_rows(len(self.ids), self.seed, step, world, micro_batch, grad_accum)].sum())

    @staticmethod
    def save(path: Path, arrays: tuple[np.ndarray, ...], report: dict) -> None:
        """Into directory `path`: ids and positions as uint16 where they fit (else int32), labels as int32 (-100
        for no label), per-row counts, the report. 8 to 12 bytes a token on disk, against 24 as int64."""
        ids, labels, positions, real = arrays
        path.mkdir()
        narrow = lambda a: a.astype(np.uint16 if a.size == 0 or int(a.max()) < 1 << 16 else np.int32)  # noqa: E731
        for name, array in (("ids", narrow(ids)), ("labels", labels.astype(np.int32)),
                            ("positions", narrow(positions)), ("real", real), ("labelled", _labelled(labels))):
            np.save(path / f"{name}.npy", array)
        (path / "report.json").write_text(json.dumps(report))

    @classmethod
    def load(cls, path: Path, vocab_size: int, seed: int) -> "PackedChat":
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r")
                  for name in ("ids", "labels", "positions", "real", "labelled")}
        return cls(arrays["ids"], arrays["labels"], arrays["positions"], arrays["real"], vocab_size, seed,
                   json.loads((path / "report.json").read_text()), labelled=np.asarray(arrays["labelled"]))


def _labelled(labels: np.ndarray) -> np.ndarray:
    """Per row: positions the loss trains on (position t when token t + 1 has a label), a row at a time."""
    return np.array([int((row[1:] != IGNORE).sum()) for row in labels], dtype=np.int64)

"""Chat and instruction data: rendered by the chat template, loss on the assistant's tokens only, packed whole.

Rows become messages (and tools) in memtrain.model.chat_rows. Each sample is rendered with the tokenizer's chat
template (`data.chat_template` replaces it); its labels are -100 everywhere but on the assistant's tokens. Where
the template marks them ({% generation %}), transformers' `return_assistant_tokens_mask` gives them; else each
assistant turn's tokens are the difference between the conversation rendered up to the turn with the generation
prompt and with the turn. The samples are rendered once into a store (memtrain.model.chat_store), not by seq_len;
a run packs them whole, first fit in file order, into rows of `data.seq_len` (PackedChat); position ids restart at
0 for each sample, so transformers' attention keeps samples apart (it reads packed sequences from the positions),
and a row's unused tail is padding with label -100. A sample that cannot be used (no assistant turn, malformed
messages, a template that raises or does not render the conversation as a prefix of its continuation, longer than
a row without `data.truncate`) is counted by reason and reported in one line, never dropped silently;
`data.truncate` keeps an over-long sample's first `data.seq_len` tokens and counts it.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

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


def encode_row(tok, row: dict, cfg: DataSection):
    """(token ids, assistant mask) of one dataset row, whatever its length, or (None, why it is skipped)."""
    messages, tools, why = row_messages(row, cfg)
    if messages is None:
        return None, why
    try:
        encoded = encode_sample(tok, messages, tools)
    except TemplateFailure as e:
        return None, f"template error: {e}"
    if encoded is None:
        return None, "template not prefix-stable"
    return encoded, None


def first_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples of `lengths` (each 1..capacity) packed whole into rows of `capacity`, first fit in order: each one's
    (row, start in the row). A tree of each row range's largest free space finds the first row with room in
    log(rows) steps (a row not yet opened has all of it)."""
    n = len(lengths)
    size = 1 << max(n - 1, 0).bit_length()
    tree = [capacity] * (2 * size)
    rows = np.empty(n, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= length else 2 * node + 1
        rows[i], starts[i] = node - size, capacity - tree[node]
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows, starts


@dataclass(frozen=True)
class ChatSamples:
    """Rendered samples end to end (memtrain.model.chat_store's files, memory-mapped): sample i is
    ids[offsets[i]:offsets[i + 1]], mask the same span (1: an assistant token), trained[i] its assistant tokens;
    `skipped`: the rows not stored, by reason; `pad_id` fills a row's unused tail."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    trained: np.ndarray
    skipped: dict
    pad_id: int

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


class PackedChat:
    """Chat/instruction samples packed into rows of data.seq_len when a run opens them: whole samples, first fit in
    store order (a sample longer than a row skipped, or its first seq_len tokens kept with data.truncate), so a new
    seq_len re-renders nothing. The same batch interface as PackedData (a pure function of the position:
    resume-exact), returning the forward's inputs and the real-token count; a batch reads only its own samples."""

    def __init__(self, samples: ChatSamples, cfg: DataSection, vocab_size: int, seed: int):
        seq_len, truncate = cfg.seq_len, cfg.truncate
        self.samples, self.seq_len, self.vocab_size, self.seed = samples, seq_len, vocab_size, seed
        self.ids, self.mask = samples.ids, samples.mask  # memory-mapped: every rank of a node shares one copy
        lengths = np.diff(np.asarray(samples.offsets, dtype=np.int64))
        long = lengths > seq_len
        self.used = np.minimum(lengths, seq_len) if truncate else lengths
        trained = np.asarray(samples.trained, dtype=np.int64).copy()
        for i in np.flatnonzero(long) if truncate else ():  # a truncated sample trains on its kept part only
            trained[i] = int(np.count_nonzero(self._mask(i)))
        skipped = Counter(samples.skipped)
        if not truncate:
            skipped["longer than data.seq_len"] += int(long.sum())
        unlabelled = (trained == 0) & (truncate | ~long)
        skipped["no assistant token within data.seq_len"] += int((unlabelled & long).sum())
        skipped["no assistant token in the rendering"] += int((unlabelled & ~long).sum())
        kept = np.flatnonzero((truncate | ~long) & ~unlabelled)
        if not len(kept):
            raise UserError(f"data.paths: no usable {cfg.format} sample in {len(lengths) + sum(samples.skipped.values())} "
                            f"row(s) ({_skipped_text(+skipped)})")
        rows, starts = first_fit(self.used[kept], seq_len)
        order = np.lexsort((starts, rows))
        self._kept, self._row_ptr = kept[order], np.searchsorted(rows[order], np.arange(rows.max() + 2))
        n_rows = int(rows.max()) + 1
        self.real = np.bincount(rows, weights=self.used[kept], minlength=n_rows).astype(np.int64)
        # the loss trains on position t when token t + 1 has a label: a row's first token is never a target
        first = self._kept[self._row_ptr[:-1]]
        self.labelled = (np.bincount(rows, weights=trained[kept], minlength=n_rows).astype(np.int64)
                         - np.asarray(samples.mask[np.asarray(samples.offsets)[first]], dtype=np.int64))
        self.report = {"samples": len(kept), "rows": n_rows, "real_tokens": int(self.real.sum()),
                       "trained_tokens": int(trained[kept].sum()), "skipped": dict(+skipped),
                       "truncated": int(long[kept].sum())}

    def _mask(self, sample: int) -> np.ndarray:
        start = int(self.samples.offsets[sample])
        return np.asarray(self.mask[start:start + self.used[sample]], dtype=bool)

    def __len__(self) -> int:
        return len(self.real)

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> dict:
        return self.rows(order.micro_rows(len(self), self.seed, step, micro, rank, world, micro_batch, grad_accum))

    def rows(self, rows: np.ndarray) -> dict:
        """Rows by index: the forward's inputs as int64 and their real-token count (eval reads its rows in order).
        Samples sit end to end from the row's start, positions restarting at 0 for each; the unused tail is padding
        with label -100 and positions of its own."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        ids = np.full((len(rows), self.seq_len), self.samples.pad_id, dtype=np.int64)
        labels = np.full((len(rows), self.seq_len), IGNORE, dtype=np.int64)
        positions = np.zeros((len(rows), self.seq_len), dtype=np.int64)
        for j, r in enumerate(rows.tolist()):
            at = 0
            for sample in self._kept[self._row_ptr[r]:self._row_ptr[r + 1]].tolist():
                n, start = int(self.used[sample]), int(self.samples.offsets[sample])
                x = np.asarray(self.ids[start:start + n], dtype=np.int64)
                ids[j, at:at + n] = x
                labels[j, at:at + n] = np.where(self._mask(sample), x, IGNORE)
                positions[j, at:at + n] = np.arange(n)
                at += n
            positions[j, at:] = np.arange(self.seq_len - at)  # the padding: a segment of its own
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions), "tokens": int(self.real[rows].sum())}

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """Tokens with a label in all of `step`'s micro-batches on all `world` data ranks (each rank can name every
        rank's rows: memtrain.model.order), counted as the loss counts them: position t is trained on when
        token t + 1 is labelled."""
        return int(self.labelled[order.step_rows(len(self), self.seed, step, world, micro_batch, grad_accum)].sum())

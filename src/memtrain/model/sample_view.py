"""Rows of seq_len cut from a token store without copying it: the stream of the chosen documents (each followed by
its EOS) end to end, row i = stream[i * seq_len:(i + 1) * seq_len], located through the cumulative document lengths
(Megatron's sample index). A new seq_len or split costs one cumsum over the documents, no tokenizing."""
from __future__ import annotations

from typing import Optional

import numpy as np

from memtrain.config.recipe import DataSection
from memtrain.errors import UserError
from memtrain.model.token_store import TokenStore


class SampleView:
    """A 2-D array's reading surface over a store (`len`, `shape`, `view[rows]`), what PackedData reads rows from."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, chosen: Optional[np.ndarray] = None):
        """`chosen`: the documents' indices in store order (None: every document, the stream is the token file)."""
        self.tokens = tokens
        self.seq_len = seq_len
        self.dtype = tokens.dtype
        if chosen is None:
            self._starts = self._ends = None
            stream = int(offsets[-1]) if len(offsets) else 0
        else:
            chosen = np.asarray(chosen, dtype=np.int64)
            self._starts = np.asarray(offsets[chosen])  # where each chosen document starts in the store
            self._ends = np.cumsum(np.asarray(offsets[chosen + 1]) - self._starts)  # where each ends in the stream
            self._stream_starts = np.concatenate([np.zeros(1, np.int64), self._ends[:-1]])
            stream = int(self._ends[-1]) if len(chosen) else 0
        self.stream_tokens = stream
        self.shape = (stream // seq_len, seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows) -> np.ndarray:
        """Rows `rows` (an index array) as [len(rows), seq_len] in the store's dtype."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside 0..{len(self) - 1}")
        positions = rows[:, None] * self.seq_len + np.arange(self.seq_len)  # stream positions, [k, seq_len]
        if self._ends is None:
            if len(rows) == 1 or np.all(np.diff(rows) == 1):  # one contiguous read
                first = int(rows[0]) * self.seq_len if len(rows) else 0
                return np.asarray(self.tokens[first: first + len(rows) * self.seq_len]).reshape(-1, self.seq_len)
            return np.asarray(self.tokens[positions])
        doc = np.searchsorted(self._ends, positions, side="right")
        return np.asarray(self.tokens[self._starts[doc] + positions - self._stream_starts[doc]])


def split_view(store: TokenStore, cfg: DataSection, split: str, n_files: int) -> SampleView:
    """`split`'s rows of data.seq_len: every document for train when data.eval_fraction is 0, else the documents
    whose content hash falls on that side (no eval document is ever in a training row). One line when a side
    is left without a row."""
    if not cfg.eval_fraction:
        if split == "eval":
            raise UserError("data.eval_fraction: 0, so there is no eval split (set it, e.g. data.eval_fraction=0.01)")
        view = SampleView(store.tokens, store.offsets, cfg.seq_len)
        if len(view) == 0:
            raise UserError(f"data.paths: {n_files} file(s) hold {view.stream_tokens} tokens, "
                            f"fewer than one sequence of data.seq_len={cfg.seq_len}")
        return view
    is_eval = store.eval_documents(cfg.eval_fraction)
    views = {name: SampleView(store.tokens, store.offsets, cfg.seq_len, np.flatnonzero(side))
             for name, side in (("train", ~is_eval), ("eval", is_eval))}
    for name, view in views.items():
        if len(view) == 0:
            n_eval = int(is_eval.sum())
            raise UserError(f"data.eval_fraction={cfg.eval_fraction}: leaves no {name} rows of data.seq_len="
                            f"{cfg.seq_len} ({n_eval} eval and {store.documents - n_eval} train documents; "
                            f"{name} holds {view.stream_tokens} tokens)")
    return views[split]

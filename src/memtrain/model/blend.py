"""A blend of corpora (data.sources) as one set of rows: each source's share of the rows follows its weight in
every prefix of the blend (Megatron's blended dataset: row i goes to the source furthest behind its share), so
it is a pure function of the sources' row counts and weights, and resume stays exact."""
from __future__ import annotations

import numpy as np


def shares(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Rows per source in a blend of rows.sum() rows: weight-proportional, largest remainders rounded up."""
    total = int(rows.sum())
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, k) of each blend row: source s's k-th row sits at its ideal place (k + 0.5) / share_s, ties to the
    lower source; so in every prefix each source is within about one row of its share."""
    total = int(counts.sum())
    ideal = np.concatenate([(np.arange(c) + 0.5) * total / c for c in counts if c])
    source = np.concatenate([np.full(c, s, dtype=np.int32) for s, c in enumerate(counts) if c])
    k = np.concatenate([np.arange(c, dtype=np.int64) for c in counts if c])
    order = np.lexsort((source, ideal))
    return source[order], k[order]


class BlendView:
    """Rows of several SampleViews mixed by weight, with the reading surface of one (`len`, `shape`, `view[rows]`).
    Blend row i is row perm_s[k % rows_s] of source s = source[i] (k = its count so far): a source shorter than its
    share repeats (epochs > 1), a longer one gives a seeded subset of its rows."""

    def __init__(self, views: list, weights: list[float], seed: int):
        self.views = views
        self.rows = np.array([len(v) for v in views], dtype=np.int64)
        self.counts = shares(self.rows, np.asarray(weights, dtype=np.float64))
        self.source, self.k = interleave(self.counts)
        self._perm = [np.random.default_rng([seed, 104729, s]).permutation(n) for s, n in enumerate(self.rows)]
        seq_len = views[0].shape[1]
        self.shape = (int(self.rows.sum()), seq_len)
        self.dtype = np.result_type(*[v.dtype for v in views])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.empty((len(rows), self.shape[1]), dtype=self.dtype)
        source, k = self.source[rows], self.k[rows]
        for s in np.unique(source):
            where = source == s
            out[where] = self.views[s][self._perm[s][k[where] % self.rows[s]]]
        return out

    def plan(self, run_rows: int) -> list[dict]:
        """Per source: its tokens (rows x seq_len), its share of the blend's rows, and the epochs of it that a run
        reading `run_rows` rows takes."""
        total = len(self)
        return [{"rows": int(n), "tokens": int(n) * self.shape[1], "share": float(c) / total,
                 "epochs": run_rows * float(c) / total / n} for n, c in zip(self.rows, self.counts)]

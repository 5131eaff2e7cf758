"""A synthetic text corpus of a given size, written as JSON lines (`make bench-data` and the token store's tests):
seeded, so the same size and seed give the same bytes; documents of varied length over a Zipf-like vocabulary."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = 5000


def _vocabulary(rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lengths = rng.integers(1, 10, WORDS)
    return np.array(["".join(rng.choice(letters, n)) for n in lengths])


def write_corpus(path: Path, size_bytes: int, seed: int = 0, doc_chars: tuple[int, int] = (200, 20_000)) -> int:
    """Write documents to `path` (JSON lines, field "text") until it holds at least `size_bytes`; returns the size."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng).tolist()
    cdf = np.cumsum(1.0 / np.arange(1, WORDS + 1))
    cdf /= cdf[-1]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size_bytes:
            picks = np.searchsorted(cdf, rng.random(int(rng.integers(*doc_chars)) // 6)).tolist()
            line = json.dumps({"text": " ".join([vocab[i] for i in picks]), "id": written}) + "\n"
            f.write(line)
            written += len(line)
    return written

"""transformers' own attention functions, kept before DeepSpeed's Ulysses registration replaces them
process-wide (ALL_ATTENTION_FUNCTIONS[sdpa] and the like), and restored for a block with `plain()`:
the planner's fake-tensor profile runs the plain one-rank model even in a process that trains with
sequence parallelism."""
from __future__ import annotations

from contextlib import contextmanager

_ORIGINAL: dict = {}


def remember(name: str) -> None:
    """Call before registering a wrapper for attention implementation `name`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415 transformers: heavy, imported only when this runs

    if name not in _ORIGINAL and name in ALL_ATTENTION_FUNCTIONS:
        _ORIGINAL[name] = ALL_ATTENTION_FUNCTIONS[name]


@contextmanager
def plain():
    """transformers' own attention functions inside the block."""
    if not _ORIGINAL:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415 transformers: heavy, imported only when this runs

    replaced = {name: ALL_ATTENTION_FUNCTIONS[name] for name in _ORIGINAL}
    for name, fn in _ORIGINAL.items():
        ALL_ATTENTION_FUNCTIONS[name] = fn
    try:
        yield
    finally:
        for name, fn in replaced.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn

"""User-facing errors: one line on stderr, no traceback, non-zero exit."""
from __future__ import annotations

import os
import sys
from functools import wraps


class UserError(Exception):
    """A mistake in the user's input (recipe, overrides, DeepSpeed JSON, paths).

    The message must fit on one line and name the offending file and/or key path.
    """


EXIT_USER_ERROR = 2


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def cli_entry(main):
    """Wrap a CLI `main` so UserError becomes exactly one stderr line (from rank 0 only)."""

    @wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if is_rank_zero():
                msg = " ".join(str(e).split())  # force a single line
                print(f"memtrain: error: {msg}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper

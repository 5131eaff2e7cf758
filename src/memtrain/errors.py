"""User-facing errors: one line on stderr, no traceback, non-zero exit."""
from __future__ import annotations

import argparse
import os
import sys
from functools import wraps


class UserError(Exception):
    """A mistake in the user's input (recipe, overrides, DeepSpeed JSON, paths).

    The message must fit on one line and name the offending file and/or key path.
    """


class RunFailed(Exception):
    """The run itself failed (NaN/inf loss, out of memory); summary.json records the same line."""


def not_utf8(e: UnicodeDecodeError) -> str:
    """The words for a file that is not UTF-8 text, with the first bad byte and its offset."""
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is one UserError line (`--max-steps: invalid int value: 'abc'`)
    instead of the usage text over several lines; `--help` is unchanged."""

    def error(self, message: str):
        raise UserError(f"{message.removeprefix('argument ')} (see {self.prog} --help)")


EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 1


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _name_cpu_accelerator() -> None:
    """Without CUDA, name DeepSpeed's accelerator: its auto-detection logs a warning on stderr at
    import, which would turn a one-line error into two lines."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def cli_entry(main):
    """Wrap a CLI `main` so UserError/RunFailed become exactly one stderr line (from rank 0 only)."""

    @wraps(main)
    def wrapper(*args, **kwargs):
        _name_cpu_accelerator()
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if is_rank_zero():
                msg = " ".join(str(e).split())  # force a single line
                print(f"memtrain: error: {msg}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except RunFailed as e:
            if is_rank_zero():
                print(f"memtrain: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            sys.exit(EXIT_RUN_FAILED)

    return wrapper

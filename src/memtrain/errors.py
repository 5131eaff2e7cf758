"""User-facing errors: one line on stderr, no traceback, non-zero exit.

Who prints it, in a job of several ranks: a `UserError` is about the job's inputs (recipe, JSON, flags), which every
rank reads alike, so rank 0 prints it and the others exit silently with the same code (N ranks, one line). A
`NodeError` is about the state of the node a rank runs on (its host memory, a path on node-local storage, its
devices): it can differ from rank to rank, and rank 0 may not meet it at all, so the rank that meets it prints it,
prefixed with its rank and host (`memtrain: error: [rank 9 node3] host memory: ...`). The ranks of one node that
meet the same words print them once (a marker file in the node's temporary directory, keyed by the launcher
process that started them). Nothing here waits on another rank: a peer may be gone, or blocked in a collective.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import tempfile
from functools import wraps
from pathlib import Path


class UserError(Exception):
    """A mistake in the user's input (recipe, overrides, DeepSpeed JSON, paths).

    The message must fit on one line and name the offending file and/or key path.
    """


class NodeError(UserError):
    """A mistake about this node's own state (host memory, a file or directory on node-local storage, the
    accelerator): printed by the rank that meets it, with its rank and host (see the module's docstring)."""


class RunFailed(Exception):
    """The run itself failed (NaN/inf loss, out of memory); summary.json records the same line."""


def not_utf8(e: UnicodeDecodeError) -> str:
    """The words for a file that is not UTF-8 text, with the first bad byte and its offset."""
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is one UserError line (`--max-steps: invalid int value: 'abc'`)
    instead of the usage text over several lines; `--help` is unchanged and imports nothing (torch neither).
    A command line parsed names DeepSpeed's accelerator before the command runs (see `name_cpu_accelerator`)."""

    def error(self, message: str):
        raise UserError(f"{message.removeprefix('argument ')} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        parsed = super().parse_known_args(args, namespace)  # --help has exited by now
        name_cpu_accelerator()
        return parsed


EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 1


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def rank_prefix() -> str:
    """'[rank R host] ' in a job of several ranks; '' in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return ""
    return f"[rank {os.environ.get('RANK', '?')} {socket.gethostname()}] "


def one_line(message) -> str:
    return " ".join(str(message).split())


def report_here(message) -> None:
    """Print `message` as this rank's error line, prefixed with its rank and host; the ranks of this node that
    report the same words print them once. For what only this rank may know (its node's state, its out of memory):
    the caller exits next."""
    text = one_line(message)
    if _first_on_node(text):
        print(f"memtrain: error: {rank_prefix()}{text}", file=sys.stderr, flush=True)


def _first_on_node(text: str) -> bool:
    """Whether no other rank of this launch on this node has reported `text`: the first to create the marker
    file prints. The launch is the parent process (torchrun's agent, DeepSpeed's launcher, slurmstepd) and its
    start time, so a later launch reports the same words again. Any doubt (no /proc, a read-only temporary
    directory) prints: a line twice is better than none."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return True
    parent = os.getppid()
    try:
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    except (OSError, IndexError):
        return True
    key = hashlib.sha256(f"{parent}:{started}:{text}".encode()).hexdigest()[:24]
    try:
        os.close(os.open(Path(tempfile.gettempdir()) / f"memtrain-error-{key}", os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def name_cpu_accelerator() -> None:
    """Without CUDA, name DeepSpeed's accelerator: its auto-detection logs a warning on stderr at
    import, which would turn a one-line error into two lines. Imports torch: not for `--help`."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch  # noqa: PLC0415 torch: heavy, kept off --help

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def cli_entry(main):
    """Wrap a CLI `main` so UserError/RunFailed become exactly one stderr line: from rank 0, or from the rank
    that met a NodeError (see the module's docstring)."""

    @wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except NodeError as e:
            report_here(e)
            sys.exit(EXIT_USER_ERROR)
        except UserError as e:
            if is_rank_zero():
                print(f"memtrain: error: {one_line(e)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        except RunFailed as e:
            if is_rank_zero():
                print(f"memtrain: error: {one_line(e)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_RUN_FAILED)

    return wrapper

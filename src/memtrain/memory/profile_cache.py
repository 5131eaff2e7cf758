"""Activation profiles kept on disk, keyed by everything they are measured from: a run's ranks reuse its preflight's.

A profile is a pure function of the model config, the target (with the fused loss's backend), the AC modes, the
installed torch, transformers, peft and bitsandbytes, and memtrain's own code. The key hashes all of them, so an
entry is never stale: any change is another key, measured afresh. `resolve_run` keeps profiles under
`<data.cache_dir>/profiles/` (where the token store lives: the preflight writes, the ranks read; on a node that
cannot see it, a rank measures and writes its own). Processes that share the directory and miss the same entry
measure it once: the first takes a lock file beside it, the others wait and read what it wrote (`kept_or_measured`).
An entry missing, unreadable or of another format is measured again. Nothing is kept unless a directory is set.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

T = TypeVar("T")

FORMAT = 1  # the entry's layout (ActivationProfile's fields): a new one is another key
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes")  # what runs inside a measurement

_where: dict[str, Optional[Path]] = {"dir": None}


def keep_in(directory: Optional[Path]) -> None:
    """Keep this process's profiles in `directory` (None: measure in memory only)."""
    _where["dir"] = directory


def kept_in() -> Optional[Path]:
    return _where["dir"]


@lru_cache(maxsize=1)
def code_hash() -> str:
    """memtrain's own source, every file: the meter, hooks, model builders and planner a measurement runs."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def versions() -> tuple[str, ...]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"
    return (sys.version.split()[0], *(f"{name} {version(name)}" for name in PACKAGES))


def key(config_json: str, target: dict, modes: tuple[str, ...]) -> str:
    """The entry's name: a hash of every input of the measurement."""
    inputs = [FORMAT, config_json, target, list(modes), versions(), code_hash()]
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read(name: str) -> Optional[dict]:
    """The kept entry, or None (no directory set, missing, unreadable, another key inside)."""
    directory = kept_in()
    if directory is None:
        return None
    try:
        entry = json.loads((directory / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return entry.get("profile") if isinstance(entry, dict) and entry.get("key") == name else None


def write(name: str, profile: dict) -> None:
    """Keep `profile` under `name`, whole or not at all (a temporary file renamed); a directory that cannot be
    written keeps nothing (the next process measures again)."""
    directory = kept_in()
    if directory is None:
        return
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600: readable by whoever reads the token store beside it
        with os.fdopen(fd, "w") as f:
            json.dump({"key": name, "profile": profile}, f)
        os.replace(tmp, directory / f"{name}.json")
    except (OSError, TypeError, ValueError):  # unwritable, or a value JSON cannot hold: kept nowhere
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def kept_or_measured(name: str, read_kept: Callable[[], Optional[T]], measure: Callable[[], T],
                     entry: Callable[[T], dict]) -> T:
    """What `read_kept` finds under `name`, or what `measure` gives, then kept (as `entry` of it). While one process
    measures, the others that share the directory and miss the same entry wait on its lock file and read what it
    wrote: a node's ranks that start together (src/train.py without `make train`'s preflight: torchrun, an sbatch
    script) measure a profile once, not once each on the same cores. Without a directory, or on a file system that
    cannot lock, each process measures for itself."""
    found = read_kept()
    if found is not None:
        return found
    with _measuring(name):
        found = read_kept()  # kept by the process this one waited for
        if found is None:
            found = measure()
            write(name, entry(found))
    return found


@contextmanager
def _measuring(name: str) -> Iterator[None]:
    """An exclusive lock on `name`'s lock file for the block; the kernel drops it when the holder exits, even killed.
    The lock file stays: removing it would let a newcomer lock a new file while a waiter holds the old one."""
    directory = kept_in()
    fd = None
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # unwritable, or no locks here (an NFS mount without its lock service): measured unlocked
            pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # and with it the lock

"""A token store's build in progress: a checkpoint of its complete chunks (the files' lengths, the counts, and the
reading position after the last chunk) kept in the build's temporary directory, so that a killed build continues
from its last complete chunk, byte for byte as if it had never stopped, instead of starting again."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

PROGRESS = "progress.json"
EVERY_S = 1.0  # at most one checkpoint a second: its fsyncs cost little against the chunks written between them


@dataclass
class Progress:
    """What a build has written and where it reads next: every field but `sizes` is the manifest's count so far."""

    format: int
    dtype: str
    chunks: int = 0
    tokens: int = 0
    documents: int = 0
    chars: int = 0
    position: Optional[dict] = None  # memtrain.model.corpus_reader's reading position after the last chunk
    sizes: dict = field(default_factory=dict)  # bytes of each of the store's files that hold the chunks
    skipped: dict = field(default_factory=dict)  # items not stored, by reason (chat samples: memtrain.model.chat_store)
    saved_at: float = field(default=0.0, repr=False)

    def describe(self) -> str:
        return f"chunk {self.chunks} ({self.documents} documents, {self.chars / 1e6:.1f} MB of text done)"


def read(out: Path) -> Optional[Progress]:
    """The checkpoint in a build's temporary directory, or None (no directory, no checkpoint, or one unreadable)."""
    try:
        fields = json.loads((out / PROGRESS).read_text())
        return Progress(**fields)
    except (OSError, ValueError, TypeError):
        return None


def resume(out: Path, format: int, dtype: str, files: tuple[str, ...]) -> tuple[Optional[Progress], str]:
    """The checkpoint to continue from, its files cut back to the lengths it recorded (what a killed build wrote
    after it is written again); or (None, why not) when the build must start again."""
    progress = read(out)
    if progress is None:
        return None, "it has no checkpoint"
    if (progress.format, progress.dtype, sorted(progress.sizes)) != (format, dtype, sorted(files)):
        return None, "its checkpoint is of another store format"
    for name in files:
        path = out / name
        if not path.is_file() or path.stat().st_size < progress.sizes.get(name, -1):
            return None, f"its {name} is shorter than its checkpoint says"
    for name in files:
        os.truncate(out / name, progress.sizes[name])
    progress.saved_at = time.monotonic()
    return progress, ""


def save(out: Path, progress: Progress, handles: dict, force: bool = False) -> None:
    """Checkpoint the chunks written so far (`handles`: the store's open files by name; at most every EVERY_S
    seconds unless `force`): the files flushed and fsynced first, then the checkpoint written beside them and renamed
    into place, so it never names bytes that a crash could lose."""
    now = time.monotonic()
    if not force and now - progress.saved_at < EVERY_S:
        return
    for name, f in handles.items():
        f.flush()
        os.fsync(f.fileno())
        progress.sizes[name] = f.tell()
    tmp = out / (PROGRESS + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in asdict(progress).items() if k != "saved_at"}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / PROGRESS)
    progress.saved_at = now

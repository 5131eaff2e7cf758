"""The token store: a corpus tokenized once, in document order, by worker processes with bounded memory, into a
memory-mapped token file and a document-offset index; keyed by its files and tokenizer (not by seq_len), and built
atomically by one process however many ask (memtrain.model.sample_view cuts it into rows).

A store is a directory `<cache_dir>/store-<key>/`:
  tokens.bin    every document's ids followed by EOS, end to end (uint16 when the vocabulary fits, else uint32)
  offsets.bin   int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]] (its EOS included)
  doc_hash.bin  uint64 [documents]: a fixed-salt blake2b of each document's text (the eval split's coin)
  manifest.json written last: counts, dtype, the key's inputs; a directory without it is never read
A build in progress also keeps progress.json (memtrain.model.store_progress), so a killed build continues.
The build itself takes what it stores as `Contents`: text documents here, chat rows in memtrain.model.chat_store.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import itertools
import multiprocessing
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from memtrain.config.recipe import DataSection
from memtrain.errors import UserError
from memtrain.model import store_progress
from memtrain.model.corpus_reader import positioned_documents

FORMAT = 1  # bump when the layout or what a document holds changes: old stores are then never read
MANIFEST = "manifest.json"
CHUNK_CHARS = 4_000_000  # text per worker task: memory in flight is about 2 x workers x this
CHUNK_DOCS = 4096
SPLIT_SALT = b"memtrain-eval-split-1"  # fixed: the split does not move with train.seed


@dataclass(frozen=True)
class Contents:
    """What a store holds and how a build makes it: text documents (`text_contents`) or chat samples
    (memtrain.model.chat_store). `items(position)` yields (item, its size in characters, the reading position after
    it) from a position (None: the start); `tokenize(chunk of items)` gives (ids end to end, tokens per stored
    item, one array per file of `files` after tokens.bin and offsets.bin, the items skipped by reason); `max_chars`:
    where reading stops (data.max_bytes for text; None: every file whole), for the progress bar."""

    name: str
    files: tuple[str, ...]
    items: Callable[[Optional[dict]], Iterator[tuple[object, int, dict]]]
    tokenize: Callable[[list], tuple[np.ndarray, np.ndarray, list, dict]]
    max_chars: Optional[int] = None


def default_workers() -> int:
    """The cores this process may run on (data.workers unset)."""
    return len(os.sched_getaffinity(0))


def files_hash(files: list[Path]):
    """A sha256 fed with each file's resolved path, size and mtime: the files part of a store's key."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h


def store_key(files: list[Path], cfg: DataSection, tokenizer) -> str:
    """What a store's tokens depend on: each file (resolved path, size, mtime), the tokenizer (name and a hash of
    what it encodes), data.text_key and data.max_bytes; not seq_len, micro-batch or world size."""
    h = files_hash(files)
    h.update(json.dumps([FORMAT, tokenizer.name, tokenizer.fingerprint, cfg.text_key, cfg.max_bytes]).encode())
    return h.hexdigest()[:20]


# --------------------------------------------------------------------------- reading a store

@dataclass
class TokenStore:
    """A built store, memory-mapped: nothing is read until a row is."""

    path: Path
    tokens: np.ndarray
    offsets: np.ndarray
    doc_hash: np.ndarray
    manifest: dict

    @classmethod
    def open(cls, path: Path) -> "TokenStore":
        manifest = json.loads((path / MANIFEST).read_text())
        tokens = memmap_file(path / "tokens.bin", np.dtype(manifest["dtype"]))
        return cls(path, tokens, memmap_file(path / "offsets.bin", np.int64),
                   memmap_file(path / "doc_hash.bin", np.uint64), manifest)

    @property
    def documents(self) -> int:
        return len(self.doc_hash)

    def eval_documents(self, fraction: float) -> np.ndarray:
        """Which documents the eval split holds (bool per document): those whose hash falls under `fraction`."""
        return self.doc_hash < np.uint64(min(int(fraction * 2.0 ** 64), 2 ** 64 - 1))


def memmap_file(path: Path, dtype) -> np.ndarray:
    """A store's file memory-mapped read-only (an empty file as an empty array)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def open_store(files: list[Path], cfg: DataSection, tokenizer, build: bool = True) -> TokenStore:
    """The corpus's store, built first when missing (`build=False`: FileNotFoundError instead)."""
    target = Path(cfg.cache_dir) / f"store-{store_key(files, cfg, tokenizer)}"
    workers = cfg.workers or default_workers()
    build_once(target, build, lambda tmp: write_store(tmp, files, cfg, tokenizer, workers,
                                                       text_contents(files, cfg, tokenizer)))
    return TokenStore.open(target)


def store_dtype(tokenizer) -> np.dtype:
    """uint16 where the vocabulary fits, else uint32."""
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


def text_contents(files: list[Path], cfg: DataSection, tokenizer) -> Contents:
    """A text corpus's store: its documents, each followed by EOS, and each document's text hash."""
    def items(position):
        return ((text, len(text), after) for text, after in positioned_documents(files, cfg, position))

    return Contents("text", ("tokens.bin", "offsets.bin", "doc_hash.bin"), items,
                    functools.partial(_text_tokenize, tokenizer, store_dtype(tokenizer)), cfg.max_bytes)


def _text_tokenize(tokenizer, dtype, chunk: list[str]):
    ids, lengths, hashes = tokenize_chunk(chunk, tokenizer, dtype)
    return ids, lengths, [hashes], {}


# --------------------------------------------------------------------------- one builder per store

def build_once(target: Path, build: bool, write: Callable[[Path], None]) -> None:
    """`target` (a file or a directory) written once by `write(temporary path)`, however many processes ask at
    once, on one node or several sharing the cache directory, with no collective: the first to take the target's
    file lock builds, the others wait on the lock (not on a collective with a timeout, so a corpus that takes an
    hour to tokenize kills nothing) and then load. It is written under a name unique to this host and process and
    renamed into place, so a file system without working locks still never shows a partial one. A temporary left
    by a killed or stopped builder is continued from its checkpoint where it has one (a store's), else removed; the
    builder says which in one line.

    Where the file system has no locks at all (Lustre or NFS mounted with `noflock`/`nolock`: flock raises), every
    process asking builds its own copy, the first renamed into place wins and the others discard theirs: slower,
    never wrong, and said in one line (the cache on a node-local disk, or `prepare-data` run once ahead, avoids it)."""
    if target.exists():
        return
    if not build:
        raise FileNotFoundError(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        locked = _lock(lock, target)  # released when the file closes (or the process dies)
        if target.exists():  # another process built it while this one waited
            return
        tmp = target.with_name(f"{target.stem}.tmp-{socket.gethostname()}-{os.getpid()}{target.suffix}")
        if locked:  # no builder is alive but this one: what others left is from a killed build
            _take_interrupted(target, tmp)
        try:
            write(tmp)
        except Exception:  # a bad file: the next build starts clean
            _remove(tmp)
            raise
        # a stop (Ctrl-C, SystemExit) or a kill leaves the temporary: the next build continues it
        try:
            os.replace(tmp, target)
        except OSError:  # without locks: another builder's directory is in place already, and is the same store
            if locked or not target.exists():
                raise
            _remove(tmp)
            return
        _fsync_dir(target.parent)


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # flock where the mount has none


def _lock(lock, target: Path) -> bool:
    """Take the build's exclusive lock: True; False, with one line, where the file system has no locks."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return True
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
    print(f"memtrain: data: {target.parent} has no file locks (e.g. a noflock mount): each process asking builds "
          f"{target.name} itself and the first in place wins; run `python -m memtrain prepare-data` once ahead, or "
          "put data.cache_dir on a disk with locks", file=sys.stderr, flush=True)
    return False


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _take_interrupted(target: Path, tmp: Path) -> None:
    """Temporaries of `target` left by builders that died (this process holds the lock, so none is alive): the one
    furthest on with a checkpoint (memtrain.model.store_progress) becomes `tmp`, to be continued; the others are
    removed. One line says which."""
    left = sorted(target.parent.glob(f"{target.stem}.tmp-*{target.suffix}"))
    if not left:
        return
    checkpoints = {path: store_progress.read(path) for path in left}
    resumable = [p for p in left if checkpoints[p] is not None]
    kept = max(resumable, key=lambda p: checkpoints[p].chars, default=None)
    for path in left:
        if path != kept:
            _remove(path)
    if kept is None:
        print(f"memtrain: data: an interrupted build of {target} was left ({left[0].name}); removed it, "
              "restarting the build from the start", file=sys.stderr, flush=True)
        return
    os.replace(kept, tmp)
    print(f"memtrain: data: an interrupted build of {target} was left ({kept.name}); continuing from its "
          f"{checkpoints[kept].describe()}", file=sys.stderr, flush=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- building a store

def write_store(out: Path, files: list[Path], cfg: DataSection, tokenizer, workers: int, contents: Contents) -> dict:
    """Tokenize the corpus into the store directory `out` (see the module's docstring); returns its manifest. Where
    `out` holds a killed build's checkpoint (memtrain.model.store_progress), continue from its last chunk."""
    start = time.perf_counter()
    dtype = store_dtype(tokenizer)
    progress = _continued_or_new(out, dtype, contents.files)
    handles = [open(out / name, "ab") for name in contents.files]
    tokens_f, offsets_f, *extra_f = handles
    bar = _progress_bar(files, contents.max_chars, progress.chars)
    try:
        chunks = _chunks(contents.items(progress.position))
        for chunk_chars, position, (ids, lengths, extra, skipped) in _tokenized(chunks, contents.tokenize, workers):
            tokens_f.write(ids.tobytes())
            offsets_f.write((progress.tokens + np.cumsum(lengths)).tobytes())
            for f, array in zip(extra_f, extra):
                f.write(array.tobytes())
            progress.tokens += int(lengths.sum())
            progress.documents += len(lengths)
            progress.chars += chunk_chars
            progress.chunks += 1
            progress.position = position
            for why, n in skipped.items():
                progress.skipped[why] = progress.skipped.get(why, 0) + n
            store_progress.save(out, progress, dict(zip(contents.files, handles)))
            bar.update(chunk_chars)
    finally:
        bar.close()
        for f in handles:
            f.flush()
            os.fsync(f.fileno())
            f.close()
    (out / store_progress.PROGRESS).unlink(missing_ok=True)
    manifest = {"format": FORMAT, "contents": contents.name, "documents": progress.documents, "tokens": progress.tokens,
                "chars": progress.chars, "skipped": progress.skipped, "dtype": dtype.name,
                "vocab_size": tokenizer.vocab_size, "eos": tokenizer.eos_token_id, "tokenizer": tokenizer.name,
                "text_key": cfg.text_key, "max_bytes": contents.max_chars,
                "files": [str(f.resolve()) for f in files],
                "workers": workers, "seconds": round(time.perf_counter() - start, 3)}
    with open(out / MANIFEST, "w") as f:  # last: a directory without it was never finished
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(out)
    return manifest


def _continued_or_new(out: Path, dtype: np.dtype, files: tuple[str, ...]) -> store_progress.Progress:
    """A killed build's checkpoint in `out`, its files cut back to it; else `out` made afresh, with one line when a
    left build cannot be continued."""
    if out.exists():
        progress, why = store_progress.resume(out, FORMAT, dtype.name, files)
        if progress is not None:
            return progress
        print(f"memtrain: data: the interrupted build in {out} cannot be continued ({why}); restarting it from the "
              "start", file=sys.stderr, flush=True)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in files:
        (out / name).write_bytes(np.zeros(1, np.int64).tobytes() if name == "offsets.bin" else b"")
    return store_progress.Progress(FORMAT, dtype.name)


def _progress_bar(files: list[Path], max_chars: Optional[int], done: int = 0):
    """Bytes read, MB/s and ETA on the building process; off for a small corpus (done in seconds)."""
    total = sum(f.stat().st_size for f in files)
    total = min(total, max_chars) if max_chars else total
    return tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="memtrain: tokenizing", dynamic_ncols=True,
                mininterval=1.0, disable=total < 32_000_000 and not sys.stderr.isatty())


def _chunks(items: Iterator[tuple[object, int, dict]]) -> Iterator[tuple[list, int, dict]]:
    """Items in order, grouped into worker tasks of about CHUNK_CHARS characters, each with its size and the reading
    position after its last item. A chunk ends where the items since the last one reach a size, so a build continued
    from a chunk's end cuts the chunks that follow as an uninterrupted build does."""
    chunk: list = []
    size = 0
    position = None
    for item, chars, position in items:
        chunk.append(item)
        size += chars
        if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk, size, position
            chunk, size = [], 0
    if chunk:
        yield chunk, size, position


def _tokenized(chunks: Iterator[tuple[list, int, dict]], tokenize: Callable, workers: int):
    """(characters, position, tokenize(chunk)) for each chunk, in chunk order whatever the worker count: one worker,
    or a corpus of one chunk, tokenizes here; more run in forked processes, at most 2 x workers chunks in flight."""
    chunks = iter(chunks)
    head = [c for c in (next(chunks, None), next(chunks, None)) if c is not None]
    if workers <= 1 or len(head) < 2:
        for chunk, size, position in itertools.chain(head, chunks):
            yield size, position, tokenize(chunk)
        return
    yield from _tokenized_in_pool(itertools.chain(head, chunks), tokenize, workers)


def _tokenized_in_pool(chunks: Iterator[tuple[list, int, dict]], tokenize: Callable, workers: int):
    context = multiprocessing.get_context("fork")  # the tokenizer is inherited, not pickled
    pool = context.Pool(workers, initializer=_init_worker, initargs=(tokenize,))
    try:
        pending: deque = deque()
        for chunk, size, position in chunks:
            pending.append((size, position, pool.apply_async(_tokenize_in_worker, (chunk,))))
            if len(pending) >= 2 * workers:
                size, position, result = pending.popleft()
                yield size, position, result.get()
        while pending:
            size, position, result = pending.popleft()
            yield size, position, result.get()
        pool.close()  # every chunk done: the workers exit
    finally:
        pool.terminate()  # after close() a no-op for exited workers; on an error or a stop, ends them
        pool.join()


_WORKER: dict = {}


def _init_worker(tokenize: Callable) -> None:
    """A worker forked from a run inherits its stop-signal handlers (memtrain.train.signals records SIGTERM rather than
    dying): a worker dies on SIGTERM (the pool's terminate) and leaves SIGINT and SIGUSR1 to the building process."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _WORKER.update(tokenize=tokenize)


def _tokenize_in_worker(chunk: list):
    return _WORKER["tokenize"](chunk)


def tokenize_chunk(texts: list[str], tokenizer, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk's documents as (ids end to end, each followed by EOS; tokens per document; text hash per document)."""
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    for x, stop in zip(ids, ends):
        if len(x) and int(x.max()) > np.iinfo(dtype).max:
            raise UserError(f"data.tokenizer: id {int(x.max())} exceeds the tokenizer's vocabulary size "
                            f"{tokenizer.vocab_size}")
        out[stop - len(x) - 1: stop - 1] = x
    out[ends - 1] = tokenizer.eos_token_id
    hashes = np.fromiter((int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8, key=SPLIT_SALT).digest(),
                                         "little") for t in texts), dtype=np.uint64, count=len(texts))
    return out, lengths, hashes


"""Local text data: load with `datasets`, tokenize, pack into fixed-length sequences, cache.

Batches are a pure function of (step, micro-step, rank), so a resumed run reads exactly
the samples an uninterrupted run would have read: no sampler state to save.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from memtrain.errors import NodeError, UserError
from memtrain.config.recipe import DataSection
from memtrain.model import order

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # everything else: "text"


def builder_for(path: Path) -> str:
    """The `datasets` builder that reads a data file, by its suffix: json, parquet, or text."""
    return _BUILDERS.get(path.suffix.lower(), "text")


# --------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus EOS = 256. Needs no files."""

    name = "byte"
    eos_token_id = 256
    vocab_size = 257
    hf = None  # no transformers tokenizer, so no chat template

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """Any tokenizer saved in a local directory (AutoTokenizer, local files only)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.name = str(Path(path).resolve())
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types for a bad directory
            raise NodeError(f"data.tokenizer: cannot load tokenizer from '{path}': {str(e).splitlines()[0]}") from None
        eos = self._tok.eos_token_id
        self.eos_token_id = eos if eos is not None else self._tok.sep_token_id
        self.vocab_size = len(self._tok)

    @property
    def hf(self):
        """The transformers tokenizer itself (its chat template: memtrain.model.chat_data)."""
        return self._tok

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self._tok(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]


def build_tokenizer(spec: Optional[str]):
    """data.tokenizer as the validated recipe holds it (memtrain.config.recipe fills in the default)."""
    if spec in ("byte", None):
        return ByteTokenizer()
    if not Path(spec).is_dir():
        raise NodeError(f"data.tokenizer: '{spec}' is neither 'byte' nor an existing tokenizer directory")
    return HFTokenizer(spec)


# --------------------------------------------------------------------------- files

def default_corpus_files() -> list[Path]:
    """The embedded default corpus: this Python's own standard-library sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def resolve_files(cfg: DataSection) -> list[Path]:
    if not cfg.paths:
        files = default_corpus_files()
        if not files:
            raise UserError("data.paths: empty, and no standard-library sources were found for the default corpus")
        return files
    files: list[Path] = []
    for i, pattern in enumerate(cfg.paths):
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [Path(m) for m in matches if Path(m).is_file()]
        if not matches:
            raise NodeError(f"data.paths[{i}]: '{pattern}' matches no file")
        files.extend(matches)
    return files


def _read_texts(files: list[Path], cfg: DataSection, cache_dir: Path) -> list[str]:
    """Load documents with `datasets` (text, JSON lines or parquet), up to cfg.max_bytes."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read: memtrain's one line says so
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(builder_for(f), []).append(str(f))
    texts: list[str] = []
    budget = cfg.max_bytes or float("inf")
    for builder, paths in groups.items():
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=paths, split="train",
                                       cache_dir=str(cache_dir / "hf"), **kwargs)
        except Exception as e:  # a corrupt file surfaces as one of many datasets/arrow errors
            raise NodeError(f"data.paths: cannot read {builder} files ({paths[0]} ...): {str(e).splitlines()[0]}") from None
        column = "text" if builder == "text" else cfg.text_key
        if column not in ds.column_names:
            raise UserError(f"data.text_key: column '{column}' not in {paths[0]} (columns: {', '.join(ds.column_names)})")
        for text in ds[column]:
            if isinstance(text, str) and text.strip():
                texts.append(text[: int(min(budget, len(text)))])  # no max_bytes: budget is inf
                budget -= len(texts[-1])
                if budget <= 0:
                    return texts
    return texts


def _read_rows(files: list[Path], cfg: DataSection, cache_dir: Path) -> list[dict]:
    """Chat/instruction rows (JSON lines or parquet) with the columns the format reads."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read: memtrain's one line says so
    from memtrain.model.chat_rows import columns

    keys, optional = columns(cfg)
    rows: list[dict] = []
    for f in files:
        builder = builder_for(f)
        if builder == "text":
            raise UserError(f"data.paths: {f}: data.format '{cfg.format}' reads JSON lines or parquet, not "
                            f"{f.suffix or 'extensionless'} files")
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f)], split="train", cache_dir=str(cache_dir / "hf"))
        except Exception as e:  # a corrupt file surfaces as one of many datasets/arrow errors
            raise NodeError(f"data.paths: cannot read {f}: {str(e).splitlines()[0]}") from None
        missing = [k for k in keys if k not in ds.column_names]
        if missing:
            key = {cfg.messages_key: "messages_key", cfg.prompt_key: "prompt_key"}.get(missing[0], "response_key")
            raise UserError(f"data.{key}: column '{missing[0]}' not in {f} (columns: {', '.join(ds.column_names)})")
        rows.extend(ds.select_columns(keys + [k for k in optional if k in ds.column_names]).to_list())
    return rows


def _cache_key(files: list[Path], cfg: DataSection, tokenizer) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([tokenizer.name, cfg.seq_len, cfg.max_bytes, cfg.text_key]).encode())
    if cfg.format != "text":  # the rendering depends on the template and the columns too
        template = getattr(tokenizer.hf, "chat_template", None)
        h.update(json.dumps([str(template), cfg.model_dump(mode="json", exclude={"paths", "cache_dir"})],
                            sort_keys=True).encode())
    return h.hexdigest()[:20]


# --------------------------------------------------------------------------- packed data

@dataclass
class PackedData:
    """Token sequences of length seq_len, shape [num_sequences, seq_len]."""

    sequences: np.ndarray
    vocab_size: int
    seed: int

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        """The micro-batch that `rank` trains on at (step, micro). Pure function: resume-exact."""
        return self.rows(order.micro_rows(len(self.sequences), self.seed, step, micro, rank, world, micro_batch,
                                          grad_accum))

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """Rows by index, as int64 token ids [len(indices), seq_len] (eval reads its rows in order)."""
        return torch.from_numpy(self.sequences[indices].astype(np.int64))

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """Tokens with a label in all of `step`'s micro-batches on all `world` data ranks: every position of a
        row but the last (it has no next token)."""
        return grad_accum * world * micro_batch * (self.sequences.shape[1] - 1)


@dataclass
class RandomTokens:
    """`data.random_tokens`: seeded random ids in [0, vocab_size), the same interface as PackedData.
    A batch is a pure function of its position, like PackedData's, so resume stays exact."""

    vocab_size: int
    seq_len: int
    seed: int

    def batch(self, step: int, micro: int, rank: int, world: int, micro_batch: int, grad_accum: int) -> torch.Tensor:
        first = ((step * grad_accum + micro) * world + rank) * micro_batch
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + first)
        return torch.randint(0, self.vocab_size, (micro_batch, self.seq_len), generator=generator)

    def labelled_tokens(self, step: int, world: int, micro_batch: int, grad_accum: int) -> int:
        """As PackedData's: every position of a row but the last."""
        return grad_accum * world * micro_batch * (self.seq_len - 1)


def to_device(batch, device: torch.device):
    """Host batch (a tensor, or a dict of them) -> device without blocking the host: pinned memory and a
    non-blocking copy on the current stream (ordered before the forward that reads it; the caching host
    allocator keeps the pinned buffer alive until the copy is done)."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def prepare_data(cfg: DataSection, seed: int, build: bool = True):
    """Tokenize and pack the corpus, or load the cached packing (`build=False` only loads): PackedData, or
    PackedChat for data.format chat / instruction (memtrain.model.chat_data)."""
    files = resolve_files(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer)
    cache_dir = Path(cfg.cache_dir)
    if cfg.format != "text":
        from memtrain.model import chat_data

        chat_data.check_template(tokenizer, cfg)
        cache_file = cache_dir / f"chat-{_cache_key(files, cfg, tokenizer)}.npz"
        _build_once(cache_file, build, lambda tmp: chat_data.PackedChat.save(
            tmp, *chat_data.build(_read_rows(files, cfg, cache_dir), tokenizer, cfg)))
        return chat_data.PackedChat.load(cache_file, tokenizer.vocab_size, seed)
    cache_file = cache_dir / f"packed-{_cache_key(files, cfg, tokenizer)}.npy"
    _build_once(cache_file, build, lambda tmp: np.save(tmp, _pack(files, cfg, tokenizer, cache_dir)))
    return PackedData(np.load(cache_file, mmap_mode="r"), tokenizer.vocab_size, seed)


def _build_once(cache_file: Path, build: bool, write) -> None:
    """`cache_file` written once by `write(temporary path)`, however many processes ask at once, on one node or
    several sharing the cache directory, with no collective: the first to take the cache's file lock builds,
    the others wait on the lock (not on a collective with a timeout, so a corpus that takes an hour to pack
    kills nothing) and then load. The file is written under a name unique to this host and process and moved
    into place atomically, so a file system without working locks still never shows a partial file."""
    import fcntl
    import socket

    if cache_file.exists():
        return
    if not build:
        raise FileNotFoundError(cache_file)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_file.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if not cache_file.exists():  # another process built it while this one waited
            tmp = cache_file.with_name(f"{cache_file.stem}.tmp-{socket.gethostname()}-{os.getpid()}{cache_file.suffix}")
            write(tmp)
            os.replace(tmp, cache_file)


def _pack(files: list[Path], cfg: DataSection, tokenizer, cache_dir: Path) -> np.ndarray:
    texts = _read_texts(files, cfg, cache_dir)
    ids = tokenizer.encode_batch(texts)
    eos = np.array([tokenizer.eos_token_id], dtype=np.int64)
    stream = np.concatenate([np.concatenate([x.astype(np.int64), eos]) for x in ids]) if ids else eos[:0]
    n = len(stream) // cfg.seq_len
    if n == 0:
        raise UserError(f"data.paths: {len(files)} file(s) hold {len(stream)} tokens, "
                        f"fewer than one sequence of data.seq_len={cfg.seq_len}")
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    return stream[: n * cfg.seq_len].reshape(n, cfg.seq_len).astype(dtype)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what tokenizers' ByteLevel pre-tokenizer uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def save_tokenizer(spec: Optional[str], out: Path) -> None:
    """The run's tokenizer: a local HF tokenizer is copied; memtrain's 'byte' tokenizer (ids 0..255 =
    UTF-8 bytes, 256 = EOS) is written as an equivalent byte-level fast tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec not in ("byte", None):
        AutoTokenizer.from_pretrained(spec, local_files_only=True).save_pretrained(out)
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)

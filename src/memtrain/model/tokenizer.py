"""Tokenizers that need no network: memtrain's byte tokenizer and a local Hugging Face tokenizer directory,
each with a fingerprint of what it encodes (part of the token store's key), and the tokenizer written beside a model."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from memtrain.errors import NodeError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus EOS = 256. Needs no files."""

    name = "byte"
    fingerprint = "byte-utf8-eos256"
    eos_token_id = 256
    vocab_size = 257
    hf = None  # no transformers tokenizer, so no chat template

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """Any tokenizer saved in a local directory (AutoTokenizer, local files only)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # noqa: PLC0415 transformers: heavy, imported only when this runs

        self.name = str(Path(path).resolve())
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises many types for a bad directory
            raise NodeError(f"data.tokenizer: cannot load tokenizer from '{path}': {str(e).splitlines()[0]}") from None
        eos = self._tok.eos_token_id
        self.eos_token_id = eos if eos is not None else self._tok.sep_token_id
        self.vocab_size = len(self._tok)
        self._fingerprint: Optional[str] = None

    @property
    def hf(self):
        """The transformers tokenizer itself (its chat template: memtrain.model.chat_data)."""
        return self._tok

    @property
    def fingerprint(self) -> str:
        """A hash of what the tokenizer encodes: the fast tokenizer's whole JSON (vocabulary, merges, normalizer,
        pre-tokenizer), else its vocabulary, plus its added tokens and EOS."""
        if self._fingerprint is None:
            backend = getattr(self._tok, "backend_tokenizer", None)
            spec = backend.to_str() if backend is not None else json.dumps(sorted(self._tok.get_vocab().items()))
            extra = json.dumps([sorted(self._tok.get_added_vocab().items()), self.eos_token_id, self.vocab_size])
            self._fingerprint = hashlib.sha256((spec + extra).encode()).hexdigest()[:20]
        return self._fingerprint

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # the fast tokenizer's Rust encoder itself: the same ids as transformers' call (tests/unit/model/test_token_store.py),
            # without the offsets and masks that call computes and then drops here. 5.45 against 3.61 MB/s on one
            # core (byte-level BPE of 8,000 tokens, 5 MB of synthetic JSON lines, 2026-11-26, this 2-core machine)
            return [np.asarray(e.ids, dtype=np.int64) for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        ids = self._tok(texts, add_special_tokens=False)["input_ids"]  # a slow (Python) tokenizer
        return [np.asarray(x, dtype=np.int64) for x in ids]


def build_tokenizer(spec: Optional[str]):
    """data.tokenizer as the validated recipe holds it (memtrain.config.recipe fills in the default)."""
    if spec in ("byte", None):
        return ByteTokenizer()
    if not Path(spec).is_dir():
        raise NodeError(f"data.tokenizer: '{spec}' is neither 'byte' nor an existing tokenizer directory")
    return HFTokenizer(spec)


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
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415 transformers: heavy, imported only when this runs

    if spec not in ("byte", None):
        AutoTokenizer.from_pretrained(spec, local_files_only=True).save_pretrained(out)
        return

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)

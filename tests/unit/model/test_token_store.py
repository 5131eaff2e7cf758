"""The token store (memtrain.model.token_store) and the rows cut from it (memtrain.model.sample_view): today's packed
batches for the default corpus, a new seq_len without tokenizing, the eval split, an interrupted build, the worker
count, bounded memory, and bad input as one line."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from memtrain.config.recipe import load_recipe
from memtrain.errors import NodeError, UserError
from memtrain.model.data import PackedData, prepare_data


def _cfg(*overrides):
    return load_recipe(None, list(overrides)).data


def _todays_stream(cfg) -> tuple[np.ndarray, int]:
    """Today's packing before the store, written out plainly: every document read whole with `datasets`, cut at
    max_bytes characters, its UTF-8 bytes followed by EOS 256, end to end; and how many documents."""
    import datasets
    import sysconfig

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())
    ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document",
                               cache_dir=str(Path(cfg.cache_dir) / "hf-plain"))
    pieces, budget = [], cfg.max_bytes
    for text in ds["text"]:
        if text.strip():
            text = text[:budget]
            pieces += [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), np.array([256])]
            budget -= len(text)
            if budget <= 0:
                break
    return np.concatenate(pieces), len(pieces) // 2


def _files_state(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(directory.rglob("*")) if p.is_file() and "hf" not in p.parts}


def test_default_corpus_batches_equal_todays_packing_and_a_new_seq_len_tokenizes_nothing(tmp_path, capsys):
    cfg = _cfg(f"data.cache_dir={tmp_path / 'cache'}")
    data = prepare_data(cfg, seed=7)
    stream, documents = _todays_stream(cfg)
    for seq_len, view in ((128, data), (64, None)):
        if view is None:  # the same store, cut again: no file of the cache is written or replaced
            before = _files_state(tmp_path / "cache")
            view = prepare_data(_cfg(f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64"), seed=7)
            assert _files_state(tmp_path / "cache") == before
        n = len(stream) // seq_len
        packed = PackedData(stream[: n * seq_len].reshape(n, seq_len).astype(np.uint16), 257, 7)
        assert len(view) == n
        assert np.array_equal(view.rows(np.arange(n)).numpy(), packed.sequences.astype(np.int64))
        for step, micro, rank in ((0, 0, 0), (3, 1, 1), (n // 8, 0, 1)):  # the last crosses an epoch
            assert view.batch(step, micro, rank, 2, 4, 2).equal(packed.batch(step, micro, rank, 2, 4, 2))
    from memtrain.tools.prepare_data import main

    main(["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.seq_len=256"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"memtrain prepare-data: {documents} documents, {len(stream)} tokens, ")
    assert "already built" in line and f"rows of seq_len 256: train {len(stream) // 256}; store " in line


def _marked_corpus(directory: Path, docs: int = 600) -> list[str]:
    """JSON lines whose every document carries a marker found nowhere else."""
    rng = np.random.default_rng(0)
    texts = [f"<doc {i:05d}> " + "lorem ipsum " * int(rng.integers(1, 40)) + f"</doc {i:05d}>" for i in range(docs)]
    with open(directory / "marked.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return texts


def test_eval_split_holds_no_training_document_and_bad_splits_are_one_line(tmp_path):
    texts = _marked_corpus(tmp_path)
    common = [f"data.paths=[{tmp_path}/marked.jsonl]", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    train = prepare_data(_cfg(*common, "data.eval_fraction=0.2"), seed=1)
    held = prepare_data(_cfg(*common, "data.eval_fraction=0.2"), seed=2, split="eval")
    as_text = {name: bytes(view.rows(np.arange(len(view))).numpy().astype(np.uint8).ravel()).decode("utf-8", "replace")
               for name, view in (("train", train), ("eval", held))}
    ids = {name: {t[5:10] for t in texts if t[:11] in s or t[-11:] in s} for name, s in as_text.items()}
    assert not ids["train"] & ids["eval"]  # no document's marker on both sides
    assert 0.1 * len(texts) < len(ids["eval"]) < 0.3 * len(texts)
    assert len(ids["train"] | ids["eval"]) >= len(texts) - 2  # all but the stream's cut-off tail
    same = prepare_data(_cfg(*common, "data.eval_fraction=0.2"), seed=9, split="eval")  # not moved by the seed
    assert same.rows(np.arange(len(same))).equal(held.rows(np.arange(len(held))))
    with pytest.raises(UserError, match=r"^data.eval_fraction=1e-06: leaves no eval rows of data.seq_len=32 "
                                        r"\(0 eval and 600 train documents; eval holds 0 tokens\)$"):
        prepare_data(_cfg(*common, "data.eval_fraction=0.000001"), seed=1)
    with pytest.raises(UserError, match=r"^data.eval_fraction: 0, so there is no eval split"):
        prepare_data(_cfg(*common), seed=1, split="eval")


def test_a_file_unreadable_in_the_middle_of_a_build_is_one_line(tmp_path):
    """...also from a run's process, whose stop-signal handler records SIGTERM (memtrain.train.signals): the workers
    forked from it still end when the build stops (an alarm fails the test rather than letting it hang)."""
    good = [json.dumps({"text": f"document {i} " * 20}) for i in range(3000)]
    (tmp_path / "a.jsonl").write_text("\n".join(good * 30) + "\n")  # 3 chunks of work before the bad line
    (tmp_path / "b.jsonl").write_text("\n".join(good[:2000] + ['{"text": "cut'] + good[:100]) + "\n")
    recorded = []
    handlers = {sig: signal.signal(sig, lambda n, f: recorded.append(n)) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    alarm = signal.signal(signal.SIGALRM, lambda n, f: pytest.fail("the build hung"))
    signal.alarm(120)
    try:
        with pytest.raises(NodeError, match=rf"^data.paths: cannot read {tmp_path}/b.jsonl \(line 2001\): "):
            prepare_data(_cfg(f"data.paths=[{tmp_path}/*.jsonl]", f"data.cache_dir={tmp_path / 'cache'}",
                              "data.max_bytes=null", "data.workers=2"), seed=0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not recorded
    assert not [p for p in (tmp_path / "cache").glob("store-*") if p.is_dir()]  # not even a temporary


def test_a_blend_keeps_each_sources_share_in_every_prefix_and_its_mistakes_are_one_line(tmp_path, capsys):
    for name, word, docs in (("a", "alpha", 400), ("b", "beta", 3000), ("c", "gamma", 900)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(docs):
                f.write(json.dumps({"text": f"{word} " * 40 + str(i)}) + "\n")
    weights = (0.5, 0.2, 0.3)
    blend = "data.sources=[" + ", ".join(f"{{paths: [{tmp_path}/{n}.jsonl], weight: {w}}}"
                                         for n, w in zip("abc", weights)) + "]"
    common = [blend, f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64"]
    data = prepare_data(_cfg(*common), seed=3)
    rows = data.rows(np.arange(len(data))).numpy().astype(np.uint8)
    # which corpus each row came from, read from its bytes (a row holds one word only, or one word and digits/EOS)
    words = [bytes(r).decode("latin-1") for r in rows]
    source = np.array([next(i for i, w in enumerate(("alpha", "beta", "gamma")) if w[:4] in text or w[-4:] in text)
                       for text in words])
    prefix = np.arange(1, len(source) + 1)
    for s, w in enumerate(weights):
        behind = np.cumsum(source == s) - w * prefix
        assert np.abs(behind).max() <= 1.5, (s, np.abs(behind).max())
    again = prepare_data(_cfg(*common), seed=3)
    assert again.rows(np.arange(0, len(data), 7)).equal(data.rows(np.arange(0, len(data), 7)))
    from memtrain.tools.prepare_data import main

    main(["--set", common[0], "--set", common[1], "--set", common[2], "--data-parallel", "2"])
    plan = capsys.readouterr().out.strip().splitlines()[-1]
    run_rows = 40 * 8 * 1 * 2  # the tiny recipe's steps x micro-batch x grad-accum, 2 data ranks
    sizes = [len(prepare_data(_cfg(f"data.paths=[{tmp_path}/{n}.jsonl]", f"data.cache_dir={tmp_path / 'cache'}",
                                   "data.seq_len=64"), seed=0)) for n in "abc"]
    assert plan == (f"memtrain: data blend over {run_rows} rows: " + "; ".join(
        f"source {s}: {n * 64 / 1e6:.1f}M tokens, {100 * w:.1f}% of rows, {run_rows * w / n:.2f} epochs"
        for s, (n, w) in enumerate(zip(sizes, weights))))
    with pytest.raises(UserError, match=r"data.sources.1.weight: Input should be greater than 0 \(got -1\)"):
        _cfg(blend.replace("weight: 0.2", "weight: -1"))
    with pytest.raises(UserError, match=r"data.paths and data.sources are both set"):
        _cfg(blend, f"data.paths=[{tmp_path}/a.jsonl]")
    with pytest.raises(UserError, match=r"^data.sources\[0\]: data.eval_fraction=0.001: leaves no eval rows"):
        prepare_data(_cfg(*common, "data.eval_fraction=0.001"), seed=3)


def _build_logged(target: str, log: str, delay: float) -> None:
    """One process asking for `target`: its build, if it builds, appends its pid to `log` and takes `delay` s."""
    from memtrain.model.token_store import build_once

    def write(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        tmp.mkdir()
        (tmp / "manifest.json").write_text(json.dumps({"built_by": os.getpid()}))

    build_once(Path(target), True, write)


def test_processes_asking_at_once_build_a_store_once_and_a_mount_without_locks_still_builds_it(tmp_path, capsys):
    """Two processes ask for one store at once (two ranks, or two nodes sharing the cache): the file lock lets one
    build while the other waits and then reads it. Where flock raises (Lustre mounted noflock), each builds its own
    copy, the first in place wins and the other discards its copy; one line says so, and no temporary is left."""
    import multiprocessing
    from unittest import mock

    from memtrain.model import token_store

    ctx = multiprocessing.get_context("fork")
    target, log = tmp_path / "store-a", tmp_path / "built.log"
    procs = [ctx.Process(target=_build_logged, args=(str(target), str(log), 1.0)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().splitlines()) == 1 and (target / "manifest.json").is_file()

    # no locks: this process builds while "another" (simulated: the target appears during its write) got there first
    other = tmp_path / "store-b"

    def no_flock(*args):
        raise OSError(token_store.errno.ENOLCK, "No locks available")

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "manifest.json").write_text("mine")
        other.mkdir()
        (other / "manifest.json").write_text("theirs")

    with mock.patch("fcntl.flock", no_flock):
        token_store.build_once(other, True, write)
    assert (other / "manifest.json").read_text() == "theirs" and not list(tmp_path.glob("store-b.tmp-*"))
    assert "has no file locks (e.g. a noflock mount)" in capsys.readouterr().err


def test_a_local_fast_tokenizer_encodes_as_transformers_does(tmp_path):
    """The store tokenizes with the fast tokenizer's Rust encoder directly (memtrain.model.tokenizer): the same ids as
    transformers' own call, special tokens written in the text, unicode and blank lines included."""
    from transformers import AutoTokenizer

    from chatml import chatml_tokenizer
    from memtrain.model.tokenizer import build_tokenizer

    directory = chatml_tokenizer(tmp_path / "tok")
    texts = ["the user asks <|im_start|>a question<|im_end|> and the assistant answers",
             "  leading spaces, then\n\nblank lines and ümlauts — ✓ 日本語", "", "0 1 2 {\"a\": [3]}<|endoftext|>"]
    want = AutoTokenizer.from_pretrained(directory)(texts, add_special_tokens=False)["input_ids"]
    got = build_tokenizer(str(directory)).encode_batch(texts)
    assert [g.tolist() for g in got] == want
    assert any(AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids("<|im_start|>") in w for w in want)

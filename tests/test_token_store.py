"""The token store (memtrain.model.token_store) and the rows cut from it (memtrain.model.sample_view): today's packed
batches for the default corpus, a new seq_len without tokenizing, the eval split, an interrupted build, the worker
count, bounded memory, and bad input as one line."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from memtrain.config.recipe import load_recipe
from memtrain.errors import NodeError, UserError
from memtrain.model.data import PackedData, prepare_data
from memtrain.tools.bench.synthetic_corpus import write_corpus

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


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


def _store_hashes(cache: Path) -> dict:
    (store,) = [p for p in cache.glob("store-*") if p.is_dir()]
    return {name: hashlib.sha256((store / name).read_bytes()).hexdigest()
            for name in ("tokens.bin", "offsets.bin", "doc_hash.bin")}


SLOW_BUILD = textwrap.dedent("""
    import sys, time
    from memtrain.model import store_progress, token_store
    from memtrain.tools.prepare_data import main
    tokenize = token_store.tokenize_chunk
    def slow(*args):  # a chunk a quarter second: the test stops the build between two of them
        time.sleep(0.25)
        return tokenize(*args)
    token_store.tokenize_chunk, token_store.CHUNK_CHARS, store_progress.EVERY_S = slow, 1_000_000, 0.0
    main(sys.argv[1:])
""")


def _build_until(cache: Path, args: list[str], chunks: int, sig: int) -> int:
    """prepare-data in a process of its own, stopped by `sig` once its checkpoint holds `chunks` chunks; the
    chunks it held then."""
    child = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, *args, "--set", f"data.cache_dir={cache}"], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    from memtrain.model import store_progress

    while True:
        done = [p.chunks for p in map(store_progress.read, cache.glob("store-*.tmp-*")) if p is not None]
        if done and done[0] >= chunks:
            break
        assert child.poll() is None and time.time() < deadline, child.communicate()
        time.sleep(0.02)
    child.send_signal(sig)
    child.wait()
    return done[0]


def test_an_interrupted_build_is_never_read_and_continues_to_the_same_store_with_any_worker_count(tmp_path, capsys):
    """prepare-data stopped by SIGTERM, continued and killed by SIGKILL, then continued by a run with 2 workers:
    the store equals, byte for byte, an uninterrupted build's with 1 worker, and each continuation says where it
    takes up."""
    import pandas as pd

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus / "a.jsonl", 12_000_000)
    pd.DataFrame({"text": ["parquet row %d " % i * 30 for i in range(500)]}).to_parquet(corpus / "b.parquet")
    (corpus / "c.txt").write_text("a plain text document\n" * 1000)
    common = [f"data.paths=[{corpus}/*]", "data.max_bytes=null", "data.seq_len=64"]
    args = [a for s in [*common, "data.workers=1"] for a in ("--set", s)]
    killed = tmp_path / "killed"
    first = _build_until(killed, args, 2, signal.SIGTERM)
    second = _build_until(killed, args, first + 3, signal.SIGKILL)
    left = [p.name for p in killed.glob("store-*") if p.is_dir()]
    assert left and all(".tmp-" in name for name in left), left  # only a temporary
    for name in ("tokens.bin", "offsets.bin"):  # what a build writes after its last checkpoint, before a kill
        with open(killed / left[0] / name, "ab") as f:
            f.write(b"\x07" * 1000)
    with pytest.raises(FileNotFoundError):  # what a run would open: nothing
        prepare_data(_cfg(*common, f"data.cache_dir={killed}"), seed=0, build=False)
    capsys.readouterr()
    rebuilt = prepare_data(_cfg(*common, f"data.cache_dir={killed}", "data.workers=2"), seed=0)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "an interrupted build of" in said[0], said
    assert f"; continuing from its chunk {second} (" in said[0], said
    assert not list(killed.glob("store-*.tmp-*")) and not list(killed.glob("store-*/progress.json"))
    clean = prepare_data(_cfg(*common, f"data.cache_dir={tmp_path / 'clean'}", "data.workers=1"), seed=0)
    assert _store_hashes(killed) == _store_hashes(tmp_path / "clean")
    assert len(rebuilt) == len(clean) > 0
    # a temporary without a checkpoint (killed before its first chunk) is removed, and the build restarts
    stale = tmp_path / "stale" / f"{_store_name(killed)}.tmp-host-1"
    stale.mkdir(parents=True)
    capsys.readouterr()
    prepare_data(_cfg(*common, f"data.cache_dir={tmp_path / 'stale'}", "data.workers=1"), seed=0)
    assert "removed it, restarting the build from the start" in capsys.readouterr().err
    assert not stale.exists() and _store_hashes(tmp_path / "stale") == _store_hashes(tmp_path / "clean")


def _store_name(cache: Path) -> str:
    return next(p.name for p in cache.glob("store-*") if p.is_dir() and ".tmp-" not in p.name)


BUILD_AND_TRAIN_UNDER_LIMIT = textwrap.dedent("""
    import resource, sys
    import datasets.iterable_dataset, torch  # what a build imports, before the limit
    from memtrain.config.recipe import load_recipe
    from memtrain.model.build import build_config, build_model
    from memtrain.model.data import as_batch, prepare_data
    recipe = load_recipe(None, sys.argv[2:])
    torch.manual_seed(0)
    model = build_model(recipe.model, build_config(recipe.model, 257, recipe.data.seq_len))  # the tiny recipe's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def train_step(batches):
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss / len(batches)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item() * len(batches)
    train_step([torch.randint(0, 257, (8, recipe.data.seq_len))] * 2)  # AdamW's state and the heap, before the limit
    data = [l.split() for l in open("/proc/self/status") if l.startswith("VmData:")][0]
    limit = int(data[1]) * 1024 + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    rows = prepare_data(recipe.data, 0)  # the build, under the limit
    # a few steps of training on the store's shuffled rows, still under the limit
    losses = [train_step([as_batch(rows.batch(step, micro, 0, 1, 8, 2)).inputs for micro in range(2)])
              for step in range(3)]
    print(len(rows), int(rows.rows([len(rows) - 1]).sum()), *losses)
""")


def test_a_corpus_larger_than_the_memory_left_to_the_build_builds_and_trains(tmp_path):
    """RLIMIT_DATA (the heap and every private anonymous mapping) set on one process, after its imports and the
    tiny model and a first step on random ids (AdamW's state) are done, to what it uses then plus 128 MB, for 200 MB of text (400 MB of uint16
    ids): the store builds, and 3 steps of 2 micro-batches of its shuffled rows train the model (forward, backward,
    AdamW) under the same limit. Today's packing needed about 20 bytes per byte of text; a reader that copied the
    token file into memory fails here (seen: np.fromfile in TokenStore.open, MemoryError). (RLIMIT_AS cannot be
    used: torch alone reserves gigabytes of address space that it never touches.)"""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus / "part0.jsonl", 50_000_000)
    for i in range(1, 4):
        (corpus / f"part{i}.jsonl").write_bytes((corpus / "part0.jsonl").read_bytes())
    size = sum(p.stat().st_size for p in corpus.iterdir())
    headroom = 128 << 20
    assert size > headroom
    sets = [f"data.paths=[{corpus}/*.jsonl]", "data.max_bytes=null", f"data.cache_dir={tmp_path / 'cache'}",
            "data.workers=1"]
    proc = subprocess.run([sys.executable, "-c", BUILD_AND_TRAIN_UNDER_LIMIT, str(headroom), *sets], env=ENV,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, last, *losses = proc.stdout.split()
    tokens = json.loads(next((tmp_path / "cache").glob("store-*/manifest.json")).read_text())["tokens"]
    assert int(rows) == tokens // 128 and tokens > size * 0.9 and int(last) > 0
    assert len(losses) == 3 and all(0 < float(x) < 10 for x in losses), losses


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


def test_a_run_builds_its_store_with_worker_processes_and_trains_on_the_split(tmp_path):
    """2 ranks under the real launcher: the store (3 chunks, 2 worker processes forked from the rank that builds, which
    inherit the run's stop-signal handlers) is built before the ranks meet, and the run trains on the train split.
    (A worker that fails, or keeps the run's handler that records SIGTERM, hangs the rank: seen with the initializer
    left out.)"""
    from conftest import FAST, assert_ok, run_train

    write_corpus(tmp_path / "corpus.jsonl", 10_000_000)
    run = tmp_path / "run"
    proc = run_train([*FAST, "--set", f"data.paths=[{tmp_path}/corpus.jsonl]", "--set", "data.max_bytes=null",
                      "--set", "data.workers=2", "--set", "data.eval_fraction=0.1", "--set",
                      f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.save_checkpoints=false",
                      "--max-steps", "2", "--run-dir", str(run)], nproc=2, timeout=300)
    assert_ok(proc)
    (manifest,) = (tmp_path / "cache").glob("store-*/manifest.json")
    assert json.loads(manifest.read_text())["workers"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    # the held-out documents are evaluated at the end: 8 global batches (micro-batch 4 x 2 ranks) of 63 labels a row
    assert summary["eval_tokens"] == 8 * 4 * 2 * 63 and 0 < summary["eval_loss"] < 10, summary


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

"""`make bench-data`: how fast the token store builds and how much memory the build takes -> reports/data_prep.{md,json}.

    python -m memtrain.tools.bench.data_prep [--sizes 0.1,0.5,2] [--workers 1,2] [--out reports] [--work DIR]

For each synthetic corpus size (GB of JSON lines, memtrain.tools.bench.synthetic_corpus), each tokenizer (memtrain's
byte tokenizer and a BPE tokenizer trained here with `tokenizers` on the first corpus) and each worker count, one
`python -m memtrain prepare-data` process builds a fresh store. Measured: the build's seconds (the manifest's, imports
excluded) and MB/s of corpus, the peak RSS of the building process and of its workers (the largest one, from
wait4), and the peak of their sum (sampled every 50 ms). Then a second process opens the same store with another
data.seq_len and reads its first batch: the seconds it spends before that batch, beside the build's.
TOKENIZERS_PARALLELISM=false throughout: one worker is one core.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from memtrain.errors import ArgumentParser, cli_entry
from memtrain.tools.bench.synthetic_corpus import write_corpus

ROOT = Path(__file__).resolve().parents[4]
FIRST_BATCH = """
import sys, time
t = time.perf_counter()
from memtrain.config.recipe import load_recipe
from memtrain.model.data import prepare_data
import datasets, torch
imported = time.perf_counter()
data = prepare_data(load_recipe(None, sys.argv[1:]).data, 0, build=False)
data.batch(0, 0, 0, 1, 8, 1)
print(time.perf_counter() - t, time.perf_counter() - imported)
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}


def train_bpe(corpus: Path, out: Path, vocab: int = 8000) -> Path:
    """A byte-level BPE tokenizer trained on the first 20 MB of `corpus`, saved where data.tokenizer can name it."""
    if (out / "tokenizer.json").is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 tokenizers: kept off --help (this module builds the parser)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 transformers: heavy, kept off --help

    def texts():
        with open(corpus, encoding="utf-8") as f:
            read = 0
            for line in f:
                read += len(line)
                yield json.loads(line)["text"]
                if read > 20_000_000:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)
    return out


def _run_measured(argv: list[str]) -> dict:
    """Run `argv`; its wall seconds, wait4's peak RSS (the largest of it and its workers) and the sampled peak of
    their summed RSS."""
    import psutil  # noqa: PLC0415 psutil: kept off --help (this module builds the parser)

    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    root, tree_peak = psutil.Process(proc.pid), 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # wait4, not poll(): its rusage is the peak RSS
        if pid:
            break
        try:
            tree_peak = max(tree_peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
        except psutil.Error:
            pass
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {out[-2000:]}")
    return {"wall_s": time.perf_counter() - start, "max_process_rss": usage.ru_maxrss * 1024,
            "tree_rss_peak": tree_peak, "stdout": out}


def measure(corpus: Path, tokenizer: str, workers: int, cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    load = os.getloadavg()[0]  # other work on a shared machine slows the point: said beside it
    sets = [f"data.paths=[{corpus}]", "data.max_bytes=null", f"data.tokenizer={tokenizer}",
            f"data.workers={workers}", f"data.cache_dir={cache}", "data.seq_len=1024"]
    built = _run_measured([sys.executable, "-m", "memtrain", "prepare-data", *[a for s in sets for a in ("--set", s)]])
    manifest = json.loads(next(cache.glob("store-*/manifest.json")).read_text())
    reopen = subprocess.run([sys.executable, "-c", FIRST_BATCH, *sets[:-1], "data.seq_len=256"], env=_env(),
                            capture_output=True, text=True, check=True)
    size = corpus.stat().st_size
    return {"corpus_bytes": size, "tokenizer": Path(tokenizer).name, "workers": workers,
            "build_s": manifest["seconds"], "process_wall_s": round(built["wall_s"], 2),
            "mb_per_s": round(size / 1e6 / manifest["seconds"], 2), "tokens": manifest["tokens"],
            "peak_rss_process_gib": round(built["max_process_rss"] / 2 ** 30, 3),
            "peak_rss_sum_gib": round(built["tree_rss_peak"] / 2 ** 30, 3),
            "new_seq_len_first_batch_s": round(float(reopen.stdout.split()[-2]), 3),
            "new_seq_len_open_s": round(float(reopen.stdout.split()[-1]), 3), "load_avg_before": load}


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {platform.system()} {platform.release()}"


def write_report(rows: list[dict], out: Path) -> None:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_prep.json").write_text(json.dumps({"machine": _machine(), "date": when, "rows": rows}, indent=1))
    lines = ["# Token store build (make bench-data)", "",
             f"Measured {when} on {_machine()}; CPU only, not measured on GPU. Synthetic JSON lines "
             "(memtrain.tools.bench.synthetic_corpus); BPE: 8000 tokens, trained here with `tokenizers`. "
             "MB/s: corpus bytes over the build's seconds (imports excluded). Peak RSS: the largest process (the "
             "builder or one of its workers, wait4), and the sampled peak of their sum. New seq_len: a second "
             "process opening the store with another data.seq_len, to its first batch: with its imports (torch, "
             "datasets), and in brackets after them (what a run, which imports them anyway, waits for the data). Load before: "
             "the machine's 1-minute load average as the point started (other work shares its cores).", "",
             "| corpus GB | tokenizer | workers | build s | MB/s | speed-up vs 1 worker | peak RSS process GiB "
             "| peak RSS sum GiB | new seq_len: first batch s (after imports) | % of build (after imports) | load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one = next((x for x in rows if x["corpus_bytes"] == r["corpus_bytes"] and x["tokenizer"] == r["tokenizer"]
                    and x["workers"] == 1), None)
        speed = f"{r['mb_per_s'] / one['mb_per_s']:.2f}x" if one else "-"
        lines.append(f"| {r['corpus_bytes'] / 1e9:.2f} | {r['tokenizer']} | {r['workers']} | {r['build_s']:.1f} | "
                     f"{r['mb_per_s']:.1f} | {speed} | {r['peak_rss_process_gib']:.2f} | {r['peak_rss_sum_gib']:.2f} "
                     f"| {r['new_seq_len_first_batch_s']:.2f} ({r['new_seq_len_open_s']:.3f}) "
                     f"| {100 * r['new_seq_len_first_batch_s'] / r['build_s']:.1f} "
                     f"({100 * r['new_seq_len_open_s'] / r['build_s']:.2f}) | {r['load_avg_before']:.1f} |")
    (out / "data_prep.md").write_text("\n".join(lines) + "\n")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain bench-data", description="Token store build: MB/s and peak RSS "
                       "per corpus size, tokenizer and worker count -> reports/data_prep.{md,json}.")
    p.add_argument("--sizes", default="0.1,0.5,2", help="corpus sizes in GB (default 0.1,0.5,2)")
    p.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    p.add_argument("--tokenizers", default="byte,bpe", help="byte, bpe or both (default)")
    p.add_argument("--out", default=str(ROOT / "reports"), help="report directory (default reports/)")
    p.add_argument("--work", default=str(ROOT / ".cache" / "bench-data"), help="corpora, tokenizer and stores")
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        corpus = work / f"corpus-{size:g}GB.jsonl"
        if not corpus.is_file():
            write_corpus(corpus.with_suffix(".tmp"), int(size * 1e9))
            corpus.with_suffix(".tmp").rename(corpus)
        bpe = train_bpe(corpus, work / "bpe-8000")
        for tokenizer in [{"byte": "byte", "bpe": str(bpe)}[t] for t in args.tokenizers.split(",")]:
            for workers in [int(w) for w in args.workers.split(",")]:
                rows.append(measure(corpus, tokenizer, workers, work / "store"))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                write_report(rows, Path(args.out))  # each point as soon as it is measured
    shutil.rmtree(work / "store", ignore_errors=True)
    print(f"memtrain bench-data: {len(rows)} builds -> {Path(args.out) / 'data_prep.md'}")


if __name__ == "__main__":
    main()

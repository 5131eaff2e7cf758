"""`python -m memtrain.bench`: run every set-up, each in its own process, and print one table.

    python -m memtrain.bench [--recipe YAML] [--setups a,b,...] [--steps N] [--no-search] [--out DIR]

On a GPU: each set-up trains `--steps` measured steps after the recipe's
`train.metric_warmup_steps` at the recipe's micro-batch (llama-1b: 8), then its largest
micro-batch is probed by doubling until it runs out of memory (one short process per probe).
Without a GPU: nothing is measured on a GPU; a tiny CPU smoke run of the same code path runs
instead (embedded tiny recipe, two measured steps, no search) and the command exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from ..errors import UserError, cli_entry
from ..recipe import load_recipe
from .setups import DEFAULT_SETUPS, HELP, parse_setup
from .table import markdown, targets

DEFAULT_RECIPE = "recipes/llama-1b.yaml"
SMOKE = ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=2"]
SMOKE_STEPS, SMOKE_WARMUP = 2, 1
SEARCH_LIMIT = 256  # micro-batches beyond this are not probed
# DeepSpeed 0.19.8's own cpu_checkpointing loses the checkpoint on a CPU accelerator: its copy "to CPU"
# returns the same tensor, whose storage it then empties. It can only run on a GPU.
GPU_ONLY = {"deepspeed:cpu-ckpt": "DeepSpeed's own cpu_checkpointing runs on a GPU only (on a CPU accelerator "
                                  "its copy to host is the tensor itself, which it then empties)"}


def double_until_oom(fits: Callable[[int], bool], start: int, limit: int = SEARCH_LIMIT) -> dict:
    """Largest micro-batch start*2^k (<= limit) that fits, and the first that did not.
    `start` is known to fit; one probe per doubling."""
    best, mb = start, start * 2
    while mb <= limit:
        if not fits(mb):
            return {"fits": best, "oom_at": mb}
        best, mb = mb, mb * 2
    return {"fits": best, "oom_at": None}


class Runner:
    """Runs one set-up at one micro-batch in a fresh process and returns its JSON result."""

    def __init__(self, recipe: Optional[str], overrides: list[str], ds_path: str, steps: int, warmup: int):
        self.recipe, self.overrides, self.ds_path = recipe, overrides, ds_path
        self.micro_batch = load_recipe(recipe, overrides).train.micro_batch_size
        self.steps, self.warmup = steps, warmup
        self.tmp = Path(tempfile.mkdtemp(prefix="memtrain-bench-"))
        src = str(Path(__file__).resolve().parents[2])  # the worker imports memtrain from this checkout
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
                    "PYTHONWARNINGS": "ignore"}

    def __call__(self, setup: str, micro_batch: Optional[int] = None, steps: Optional[int] = None,
                 warmup: Optional[int] = None) -> dict:
        out = self.tmp / f"{len(list(self.tmp.iterdir()))}.json"
        cmd = [sys.executable, "-m", "memtrain.bench.worker", "--setup", setup, "--deepspeed", self.ds_path,
               "--steps", str(steps or self.steps), "--warmup", str(self.warmup if warmup is None else warmup),
               "--out", str(out)]
        cmd += ["--recipe", self.recipe] if self.recipe else []
        overrides = self.overrides + ([f"train.micro_batch_size={micro_batch}"] if micro_batch else [])
        for item in overrides:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        if proc.returncode == 0 and out.is_file():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = "out of memory" in (proc.stderr + proc.stdout).lower()
        return {"setup": setup, "label": parse_setup(setup).label, "micro_batch": micro_batch or self.micro_batch,
                "oom": oom, "error": " / ".join(tail) or f"exit {proc.returncode}"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memtrain.bench", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"shape to measure (default: {DEFAULT_RECIPE})")
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"comma-separated: {HELP}")
    p.add_argument("--deepspeed", default="ds_configs/zero3_ckpt.json", metavar="JSON",
                   help="ZeRO-3 JSON for the deepspeed:/memtrain: set-ups")
    p.add_argument("--steps", type=int, default=10, help="measured steps after warm-up (default 10)")
    p.add_argument("--no-search", action="store_true", help="skip the largest-micro-batch probes")
    p.add_argument("--out", type=Path, default=Path("reports/bench"), help="where the table and JSON go")
    return p


@cli_entry
def main(argv=None) -> None:
    from tqdm import tqdm

    args = parser().parse_args(argv)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    for name in names:
        parse_setup(name)  # fail on a typo before anything runs
    if args.steps < 1:
        raise UserError("--steps: must be at least 1")
    recipe = load_recipe(args.recipe)  # checked on CPU too, where the smoke pass uses the tiny recipe
    gpu = torch.cuda.is_available()
    if gpu:
        run = Runner(args.recipe, [], args.deepspeed, args.steps, recipe.train.metric_warmup_steps)
        title = f"{recipe.name} on {torch.cuda.get_device_name()}"
        stem = recipe.name
    else:
        print("memtrain bench: no CUDA GPU on this machine, so nothing is measured on a GPU. Running a tiny CPU "
              "smoke pass of the same code path instead (embedded tiny recipe, 2 layers, seq 64, micro-batch 2); "
              "its numbers are CPU numbers, not GPU measurements.", flush=True)
        run = Runner(None, SMOKE, args.deepspeed, SMOKE_STEPS, SMOKE_WARMUP)
        title, stem = "CPU smoke run (not GPU measurements)", "cpu-smoke"

    results, searches = [], {}
    for name in tqdm(names, desc="bench", unit="setup"):
        if not gpu and name in GPU_ONLY:
            results.append({"setup": name, "label": parse_setup(name).label, "micro_batch": run.micro_batch,
                            "skipped": GPU_ONLY[name]})
        else:
            results.append(run(name))
    if gpu and not args.no_search:
        for r in tqdm(results, desc="largest micro-batch", unit="setup"):
            if r.get("oom") or "tokens_per_s" not in r:
                continue
            searches[r["setup"]] = double_until_oom(
                lambda mb, name=r["setup"]: "tokens_per_s" in run(name, mb, steps=2, warmup=0), r["micro_batch"])

    table = markdown(results, searches)
    goals = targets(results) if gpu else ["- not evaluated: no GPU in this run"]
    notes = [f"- {r['setup']}: {r.get('error') or 'skipped: ' + r['skipped']}"
             for r in results if r.get("error") or r.get("skipped")]
    report = "\n".join([f"## memtrain bench: {title}", "", table, "", "Targets:", *goals]
                       + (["", "Not measured:", *notes] if notes else []))
    print(report, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(report + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"title": title, "results": results, "searches": searches},
                                                      indent=2))
    print(f"written: {args.out / (stem + '.md')}, {args.out / (stem + '.json')}", flush=True)
    shutil.rmtree(run.tmp, ignore_errors=True)
    if any(r.get("error") and not r.get("oom") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

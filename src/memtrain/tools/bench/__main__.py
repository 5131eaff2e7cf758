"""`python -m memtrain bench` (`make bench`, `make gpu-check`): set-ups side by side, each in its own process.

    python -m memtrain bench [--recipe YAML] [--setups a,b,...] [--steps N] [--no-search] [--out DIR]
    python -m memtrain gpu-check (or python -m memtrain.tools.bench --gpu-check; flags: tools/flags.py)

Every `memtrain:`/`deepspeed:` set-up is the trainer itself (`src/train.py`, the code a training
run executes) run with bench settings: random tokens, `--steps` measured steps after the
recipe's `train.metric_warmup_steps`, no model checkpoints. Its figures are the run's
`summary.json`: medians over log intervals timed with CUDA events, `max_memory_allocated`, the
planner's prediction. `torch:` set-ups are the plain-PyTorch baseline (`plain.py`). With several
GPUs the trainer runs on all of them through the deepspeed launcher; tokens/s is per GPU.

`--gpu-check`: the fixed acceptance run on `recipes/llama-1b.yaml` (30 steps per set-up: none,
full, full + offload, op, auto with half of plain no-AC's peak as budget, the plain-PyTorch and DeepSpeed
peers, and the same without leaf layers and residency) written to
`reports/gpu/<device>.md`; then the long-sequence part (memtrain.tools.bench.long_seq) written to
`reports/gpu/<device>-long.md`. Each set-up's process is killed after `--setup-timeout` seconds (300; the
long part's twice that) and the report is rewritten after every set-up; `--resume` keeps what this
device's report of the same check already measured and runs the rest of the main table, so a check split
across calls on one machine ends in one table. Without a GPU it
says so in one line and exits 0; `make bench` without a GPU runs a tiny CPU smoke pass of the same code
instead.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from memtrain.errors import UserError, cli_entry
from memtrain.config.recipe import load_recipe
from memtrain.tools.bench.setups import DEFAULT_SETUPS, parse_setup
from memtrain.tools.flags import BENCH_RECIPE, GPU_CHECK_TIMEOUT_S, bench_parser, gpu_check_parser
from memtrain.tools.bench.runner import TIMED_OUT, Runner
from memtrain.train.checkpoint import atomic_write_text
from memtrain.train.compile_choice import device_slug
from memtrain.tools.bench.table import gpu_check_markdown, gpu_check_targets, markdown, targets
from memtrain.tools.bench.long_seq import long_part_markdown, run_long_part

SMOKE = ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=2"]
SMOKE_STEPS, SMOKE_WARMUP = 2, 1
SEARCH_LIMIT = 256  # micro-batches beyond this are not probed
# the plain-PyTorch and DeepSpeed peers, memtrain with leaf layers and one-GPU residency (its default), the same
# without them (`-leaf-resident`: how memtrain ran before memtrain.config.zero3), and compiled layers (`+compile`:
# train.compile, which `train.compile: auto` reads back from this run's JSON), and LoRA beside QLoRA (a 4-bit base,
# multi-GPU under ZeRO-3 when the machine has several), all in one run
GPU_CHECK_SETUPS = ("torch:noac", "torch:hf-ac", "torch:sac", "deepspeed:cpu-ckpt",
                    "memtrain:none", "memtrain:full", "memtrain:full@deepspeed", "memtrain:full+offload",
                    "memtrain:op", "memtrain:auto",
                    "memtrain:none-leaf-resident", "memtrain:full+offload-leaf-resident", "memtrain:op-leaf-resident",
                    "memtrain:none+compile", "memtrain:full+offload+compile", "memtrain:op+compile",
                    "memtrain:auto+compile", "memtrain:full+lora", "memtrain:full+qlora")
GPU_CHECK_STEPS, GPU_CHECK_WARMUP = 20, 10  # 30 steps each
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


def setup_names(text: str) -> list[str]:
    """`--setups`' names, each checked (a typo fails before anything runs)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        parse_setup(name)
    return names


def write_gpu_check(out: Path, device: str, title: str, results: list[dict], logs: dict[str, str]) -> str:
    """reports/gpu/<device>.{md,json} (and failed.log) from the set-ups measured so far: written after each
    set-up, so a run cut short keeps what it measured and `train.compile: auto` can read it at once."""
    when = sorted(r["measured_at"] for r in results if r.get("measured_at"))
    span = [f"Measured {when[0]}" + (f" to {when[-1]}" if when[-1] != when[0] else "") + ".", ""] if when else []
    software = sorted({r["software"] for r in results if r.get("software")})  # one line a call, if they differ
    span += [f"Software: {'; '.join(software)}.", ""] if software else []
    report = "\n".join([f"## {title}", "", *span, gpu_check_markdown(results), "",
                        "Targets (each a ratio measured in this run):", *gpu_check_targets(results)])
    out.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a check killed mid-write leaves the previous report for --resume
    atomic_write_text(out / f"{device_slug(device)}.md", report + "\n")
    atomic_write_text(out / f"{device_slug(device)}.json", json.dumps({"title": title, "results": results}, indent=2))
    failed = [r["setup"] for r in results if "tokens_per_s" not in r and not r.get("oom") and r["setup"] in logs]
    if failed:  # what those processes printed, to see why
        (out / "failed.log").write_text("\n\n".join(logs[name] for name in failed))
    return report


def software_versions() -> str:
    """The versions a gpu-check measures with, as its report prints them. The packages' own metadata, found in the
    order Python imports them (so a carried `.whl` install on PYTHONPATH is the one named), without importing them."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 used only here

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return f"torch {torch.__version__}{cuda}, transformers {of('transformers')}, DeepSpeed {of('deepspeed')}"


def measured_before(out: Path, device: str, title: str, names: list[str]) -> list[dict]:
    """`--resume`: the results of this device's report in `out` that measured something (failures run again), in
    the order `names` gives them; none, with a line that says why, from a report of another check (its title names
    the recipe, the GPU count and the device) or one that cannot be read."""
    path = out / f"{device_slug(device)}.json"
    if not path.is_file():
        return []
    try:
        report = json.loads(path.read_text())
        results = report["results"]
    except (ValueError, KeyError, TypeError) as e:
        print(f"gpu-check --resume: {path} cannot be read ({e}); measuring every set-up", flush=True)
        return []
    if report.get("title") != title:
        print(f"gpu-check --resume: {path} is the report of another check ({report.get('title')!r}, not {title!r}); "
              "measuring every set-up", flush=True)
        return []
    kept = {r["setup"]: r for r in results if "tokens_per_s" in r or r.get("oom")}
    return [kept[n] for n in names if n in kept] + [r for n, r in kept.items() if n not in names]


def same_failure_twice(results: list[dict]) -> bool:
    """Whether the last two trainer set-ups that ran failed (not out of memory, not timed out) with the same error."""
    ran = [r for r in results if r["setup"].startswith(("memtrain:", "deepspeed:")) and "wall_s" in r][-2:]
    return (len(ran) == 2 and all(r.get("error") and not r.get("oom") and not r["error"].startswith(TIMED_OUT)
                                  for r in ran)
            and ran[0]["error"] == ran[1]["error"])


def gpu_check(args) -> None:
    names = setup_names(args.setups) if args.setups else list(GPU_CHECK_SETUPS)
    timeout_s = GPU_CHECK_TIMEOUT_S if args.setup_timeout is None else args.setup_timeout
    if not torch.cuda.is_available():
        print("memtrain gpu-check: no CUDA GPU on this machine; nothing measured (run it where a GPU is).", flush=True)
        return
    ngpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name()
    run = Runner(BENCH_RECIPE, [], args.deepspeed, GPU_CHECK_STEPS, GPU_CHECK_WARMUP, ngpus, timeout_s=timeout_s)
    title = f"memtrain gpu-check: {BENCH_RECIPE} (seq 2048, bf16) with {args.deepspeed} on {ngpus} x {device}"
    out = args.out or Path("reports/gpu")
    results: list[dict] = measured_before(out, device, title, names) if args.resume else []
    software = software_versions()
    if results:
        print(f"gpu-check --resume: kept {len(results)} set-ups measured earlier on this device: "
              f"{', '.join(r['setup'] for r in results)}", flush=True)
    report, stopped = "", False
    (out / "failed.log").unlink(missing_ok=True)  # an earlier run's
    bar = tqdm([n for n in names if n not in {r["setup"] for r in results}], desc="gpu-check", unit="setup")
    for name in bar:
        bar.set_postfix(setup=name)
        result = measure_setup(run, name, results)
        result["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        result["software"] = software
        results.append(result)
        tqdm.write(json.dumps(result))
        report = write_gpu_check(out, device, title, results, run.logs)
        stopped = same_failure_twice(results)
        if stopped:  # the trainer itself is broken here: stop before spending the GPU's time
            tqdm.write(f"gpu-check: stopped: two trainer set-ups in a row failed the same way: {result['error']}")
            break
    print(report, flush=True)
    failed = (out / "failed.log").exists()
    print(f"written: {out / (device_slug(device) + '.md')}" + (f"; failed set-ups' output: {out / 'failed.log'}"
                                                         if failed else ""), flush=True)
    shutil.rmtree(run.tmp, ignore_errors=True)
    if stopped:
        sys.exit(1)
    if not args.no_long:
        gpu_check_long(out, device, timeout_s)


def measure_setup(run: Runner, name: str, results: list) -> dict:
    """One gpu-check set-up's result; memtrain:auto runs under half of plain no-AC's measured peak."""
    if name not in ("memtrain:auto", "memtrain:auto+compile"):
        return run(name)
    plain = next((r for r in results if r["setup"] == "torch:noac" and r.get("peak_gib")), None)
    if plain is None:
        return {"setup": name, "label": parse_setup(name).label, "micro_batch": run.micro_batch,
                "error": "no budget: torch:noac has no measured peak (run it first)"}
    budget = f"{plain['peak_gib'] / 2:.3f}"
    result = run(name, extra=(f"activation_checkpointing.memory_budget={budget}",))
    result["label"] += f", budget {budget} GiB (half of plain no-AC's peak)"
    return result


def gpu_check_long(out: Path, device: str, timeout_s: float) -> None:
    """gpu-check's long-sequence part on one GPU (memtrain.tools.bench.long_seq), written beside its table."""
    runners = []

    def make_runner(recipe, ds_path, steps, warmup):  # long sequences take longer: twice the set-up limit
        runners.append(Runner(recipe, [], ds_path, steps, warmup, 1, timeout_s=2 * timeout_s))
        return runners[-1]

    long_results = run_long_part(make_runner, tqdm.write)
    long_report = f"## memtrain gpu-check, long sequences, on 1 x {device}\n\n" + long_part_markdown(long_results)
    print(long_report, flush=True)
    (out / f"{device_slug(device)}-long.md").write_text(long_report + "\n")
    (out / f"{device_slug(device)}-long.json").write_text(json.dumps({"results": long_results}, indent=2))
    for r in runners:
        shutil.rmtree(r.tmp, ignore_errors=True)


@cli_entry
def gpu_check_main(argv=None) -> None:
    """`python -m memtrain gpu-check`: bench's --gpu-check, under its own flags."""
    run_bench(gpu_check_parser().parse_args(argv))


@cli_entry
def main(argv=None) -> None:
    run_bench(bench_parser().parse_args(argv))


def run_bench(args: argparse.Namespace) -> None:
    """make bench, or with args.gpu_check the GPU acceptance run."""
    if args.setup_timeout is not None and args.setup_timeout <= 0:
        raise UserError(f"--setup-timeout: must be positive seconds (got {args.setup_timeout:g})")
    if args.resume and not args.gpu_check:
        raise UserError("--resume: continues a --gpu-check run; make bench has nothing to resume")
    if args.gpu_check:
        return gpu_check(args)
    names = setup_names(args.setups or ",".join(DEFAULT_SETUPS))
    if args.steps < 1:
        raise UserError("--steps: must be at least 1")
    recipe = load_recipe(args.recipe)  # checked on CPU too, where the smoke pass uses the tiny recipe
    gpu = torch.cuda.is_available()
    if gpu:
        run = Runner(args.recipe, [], args.deepspeed, args.steps, recipe.train.metric_warmup_steps,
                     torch.cuda.device_count(), timeout_s=args.setup_timeout)
        title = f"{recipe.name} on {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
        stem = recipe.name
    else:
        print("memtrain bench: no CUDA GPU on this machine, so nothing is measured on a GPU. Running a tiny CPU "
              "smoke pass of the same code path instead (embedded tiny recipe, 2 layers, seq 64, micro-batch 2); "
              "its numbers are CPU numbers, not GPU measurements.", flush=True)
        run = Runner(None, SMOKE, args.deepspeed, SMOKE_STEPS, SMOKE_WARMUP, 1, timeout_s=args.setup_timeout)
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
                lambda mb, name=r["setup"]: "tokens_per_s" in run(name, mb, steps=2, warmup=1), r["micro_batch"])

    table = markdown(results, searches)
    goals = targets(results) if gpu else ["- not evaluated: no GPU in this run"]
    notes = [f"- {r['setup']}: {r.get('error') or 'skipped: ' + r['skipped']}"
             for r in results if r.get("error") or r.get("skipped")]
    report = "\n".join([f"## memtrain bench: {title}", "", table, "", "Targets:", *goals]
                       + (["", "Not measured:", *notes] if notes else []))
    print(report, flush=True)
    out = args.out or Path("reports/bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(report + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"title": title, "results": results, "searches": searches},
                                                 indent=2))
    print(f"written: {out / (stem + '.md')}, {out / (stem + '.json')}", flush=True)
    shutil.rmtree(run.tmp, ignore_errors=True)
    if any(r.get("error") and not r.get("oom") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

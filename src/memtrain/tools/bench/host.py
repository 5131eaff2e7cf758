"""`make bench-host`: memtrain's host work per step beside plain PyTorch, on one CPU core, in one run -> reports/host_overhead.md.

    python -m memtrain bench-host [--setups a,b,...] [--steps N] [--repeats N] [--cores N] [--out DIR]

Each set-up runs in its own process pinned to `--cores` cores (default 1), on the embedded tiny
recipe (4 layers, hidden 128, seq 128), random tokens: shapes so small that kernels cost little and
what a step spends around them shows. The trainer set-ups run `src/train.py` with `train.probe: true`
(memtrain.train.zero3_probe): ZeRO-3 parameter fetches per step by phase, all-gathers, aten ops
dispatched in one step, CPU seconds per step. The plain-PyTorch peers count the same aten ops and CPU
time. `-leaf`/`-resident` set-ups are the trainer without memtrain's ZeRO-3 leaf layers / one-rank
residency (how it ran before memtrain.config.zero3), for comparison in the same run.

One core, not two: DeepSpeed gathers parameters with gloo at start-up, and gloo's worker thread then
holds a second OpenMP team; with more OpenMP threads than cores libgomp stops spinning between
parallel regions, and every 2-thread elementwise op of that process costs about 8x as much
(measured: 9 us -> 75 us for a 128k-element multiply). That is a property of gloo on a CPU, not of
memtrain or of a GPU run, so the benchmark keeps every set-up to one thread.

A shared machine drifts by about 10% between runs a minute apart, as much as the gaps measured. So
every set-up runs `--repeats` times (default 3) in interleaved rounds (each round runs every set-up
once), and the table shows, per set-up, the run with the median tokens/s and the range over rounds.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import textwrap
from datetime import date
from pathlib import Path
from typing import Optional
from importlib.metadata import version

from memtrain.errors import ArgumentParser, UserError, cli_entry
from memtrain.tools.bench.runner import Runner
from memtrain.tools.bench.setups import parse_setup

ROOT = Path(__file__).resolve().parents[4]
DS_CONFIG = "ds_configs/zero3_ckpt_no_offload.json"
SETUPS = ("torch:noac", "torch:hf-ac", "torch:sac",
          "memtrain:none-leaf-resident", "memtrain:full-leaf-resident", "memtrain:op-leaf-resident",
          "memtrain:none", "memtrain:full", "memtrain:full@deepspeed", "memtrain:op")
COLUMNS = ("set-up", "what", "tokens/s", "range", "x torch:noac", "x torch:hf-ac", "fetches/step (fwd / recompute / bwd)",
           "all-gathers/step", "aten ops/step", "CPU ms/step")


def _ratio(r: dict, base: Optional[dict]) -> str:
    return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base and "tokens_per_s" in r else "n/a"


def markdown(results: list[dict]) -> str:
    by = {r["setup"]: r for r in results if "tokens_per_s" in r}
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if "tokens_per_s" not in r:
            rows.append(f"| {r['setup']} | {r['label']} | failed: {r.get('error', '?')} |" + " |" * (len(COLUMNS) - 3))
            continue
        probe = r.get("probe") or {}
        f = probe.get("fetches")
        runs = r.get("tokens_per_s_runs") or [r["tokens_per_s"]]
        cells = [r["setup"], r["label"], f"{r['tokens_per_s']:,.0f}", f"{min(runs):,.0f}-{max(runs):,.0f}",
                 _ratio(r, by.get("torch:noac")),
                 _ratio(r, by.get("torch:hf-ac")),
                 f"{f['forward']} / {f['recompute']} / {f['backward']}" if f else "n/a (no ZeRO-3)",
                 str(probe["all_gathers"]) if "all_gathers" in probe else "n/a",
                 f"{probe['aten_ops']:,}" if probe.get("aten_ops") else "n/a",
                 f"{probe['cpu_s'] * 1000:.1f}" if probe.get("cpu_s") else "n/a"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def targets(results: list[dict]) -> list[str]:
    """The CPU targets of the recompute issue, each as measured in this run."""
    by = {r["setup"]: r for r in results if "tokens_per_s" in r}
    lines = []
    for name in ("memtrain:full", "memtrain:full@deepspeed", "memtrain:op"):
        if name in by:
            recompute = by[name]["probe"]["fetches"]["recompute"]
            lines.append(f"- ZeRO-3 fetches inside the recompute, {name}: {recompute} (target 0) - "
                         + ("met" if recompute == 0 else "NOT met"))

    def ratio(a, b, goal):
        if a in by and b in by:
            value = by[a]["tokens_per_s"] / by[b]["tokens_per_s"]
            lines.append(f"- tokens/s, {a} / {b}: {value:.2f} (target >= {goal}) - "
                         + ("met" if value >= goal else "NOT met"))
        else:
            lines.append(f"- tokens/s, {a} / {b}: not measured")

    ratio("memtrain:full", "torch:hf-ac", 0.9)
    ratio("memtrain:none", "torch:noac", 0.8)
    lines.append("- all-gather count and bytes, full recompute vs none: one rank gathers nothing; checked on 2 gloo "
                 "ranks by tests/launch/test_zero3_hooks.py")
    return lines


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, kept off --help

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, kept off --help

    rows = [r for r in results if "tokens_per_s" in r]
    base = next((r for r in rows if r["setup"] == "torch:noac"), None)
    if base is None:
        return
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.6))
    names = [r["setup"] for r in rows][::-1]
    values = [r["tokens_per_s"] / base["tokens_per_s"] for r in rows][::-1]
    colors = ["#888888" if n.startswith("torch:") else "#d62728" if n.endswith("-resident") else "#1f77b4"
              for n in names]
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v + 0.01, y, f"{v:.2f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s relative to plain PyTorch without recompute (torch:noac)")
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    from matplotlib.patches import Patch  # noqa: PLC0415 matplotlib: heavy, kept off --help

    fig.legend(handles=[Patch(color="#888888", label="plain PyTorch"),
                        Patch(color="#d62728", label="memtrain without leaf layers / residency"),
                        Patch(color="#1f77b4", label="memtrain")], fontsize=7, loc="lower center", ncol=3,
               frameon=False)
    ax.set_xlim(0, max(values) * 1.1)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))  # the legend's strip, below the axis label
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return f"{model}, {os.cpu_count()} cores"


def _versions() -> str:
    return ", ".join(f"{p} {version(p)}" for p in ("torch", "deepspeed", "transformers"))


def median_runs(runs: list[dict]) -> dict:
    """One set-up's record over its rounds: the run with the median tokens/s (the lower middle one of an
    even count), with every round's tokens/s beside it; a set-up that failed in any round shows that failure."""
    failed = [r for r in runs if "tokens_per_s" not in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def run(names: list[str], steps: int, warmup: int, cores: int, out: Path, repeats: int = 3) -> list[dict]:
    from tqdm import tqdm  # noqa: PLC0415 tqdm: kept off --help (this module builds the parser)

    available = sorted(os.sched_getaffinity(0))
    if not 1 <= cores <= len(available):
        raise UserError(f"--cores: between 1 and the {len(available)} cores this process may use, got {cores}")
    runner = Runner(None, [], str(ROOT / DS_CONFIG), steps, warmup, 1, cpus=set(available[:cores]))
    runner.env["CUDA_VISIBLE_DEVICES"] = ""  # a host benchmark: CPU processes on a GPU machine too
    runs: dict[str, list[dict]] = {name: [] for name in names}
    bar = tqdm([(i, name) for i in range(repeats) for name in names], desc="bench-host", unit="run")
    for i, name in bar:
        bar.set_postfix(round=i + 1, setup=name)
        extra = ("train.probe=true",) if parse_setup(name).trainer else ()
        runs[name].append(runner(name, extra=extra))
    shutil.rmtree(runner.tmp, ignore_errors=True)
    results = [median_runs(runs[name]) for name in names]
    title = (f"memtrain bench-host: embedded tiny recipe, 1 rank, {cores} core(s) of {_machine()}; "
             f"median of {repeats} interleaved round(s); {date.today()}; {_versions()}")
    report = "\n".join([f"## {title}", "", markdown(results), "", "Targets (CPU, this run):", *targets(results), "",
                        "tokens/s: median over log intervals after warm-up (trainer), or the timed steps (plain), "
                        "then the median run over the rounds (range: every round's); "
                        "fetches and all-gathers: per step, steady state (memtrain.train.zero3_probe); aten ops: "
                        "one step under a dispatch-mode counter; CPU ms: process CPU time per step."])
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_overhead.md").write_text(report + "\n")
    (out / "host_overhead.json").write_text(json.dumps({"title": title, "results": results}, indent=2))
    plot(results, out / "host_overhead.png", title)
    print(report, flush=True)
    print(f"written: {out / 'host_overhead.md'}, {out / 'host_overhead.png'}", flush=True)
    return results


def parser():
    p = ArgumentParser(prog="python -m memtrain bench-host", description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated set-ups (as make bench names them)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per set-up after 5 warm-up steps (default 30)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds; each set-up's median run is shown (default 3)")
    p.add_argument("--cores", type=int, default=1, help="cores each set-up's process is pinned to (default 1)")
    p.add_argument("--out", type=Path, default=Path("reports"), help="where host_overhead.{md,json,png} go")
    return p


@cli_entry
def main(argv=None) -> None:
    args = parser().parse_args(argv)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    for name in names:
        if parse_setup(name).impl == "deepspeed":
            raise UserError(f"--setups: {name} runs on a GPU only")
    if args.steps < 1:
        raise UserError("--steps: must be at least 1")
    if args.repeats < 1:
        raise UserError("--repeats: must be at least 1")
    run(names, args.steps, 5, args.cores, args.out, args.repeats)


if __name__ == "__main__":
    main()

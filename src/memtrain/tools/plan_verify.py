"""`make plan ARGS="--search ... --verify K"`: run the top K configurations (and a few random feasible ones) for a few
steps through the sweep runner, and print predicted against measured tokens/s and peak memory with their rank
correlation (Kendall's tau).

Each configuration is written as `plans/<name>/verify/<i>/ds.json` + `recipe.yaml` (what `--search` writes for its
winner) and a one-point sweep file beside them, run by `memtrain.tools.sweep.run_sweep` with the local launcher
(`deepspeed`, one process per GPU, or gloo ranks on a CPU machine) or Slurm (`--launcher slurm`). The measured figures
are the runs' own summary.json: `throughput/tokens_per_s` (median after warm-up) and `memory/peak_allocated_gib`
(CUDA's allocator; a CPU run has none). Measured runs on the sheet's device feed its calibration file: a GPU
sheet's `efficiency.compute` scaled by the median of measured over predicted tokens/s; a CPU sheet's (the CPU
proxy) overhead rates, fitted to the measured steps.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from memtrain.errors import UserError
from memtrain.memory.score import Scored
from memtrain.memory.search import SearchResult
from memtrain.units import GIB
from memtrain.memory.hardware import calibration_path, load_hardware
from memtrain.memory.overhead_fit import fit_overheads
from memtrain.tools.plan_search import write_plan
from memtrain.tools.sweep import run_sweep
from memtrain.tools.sweep_points import load_sweep, read_summary

RANDOM_EXTRA = 3  # random feasible configurations beside the top K: the ranking is checked below the top too


@dataclass
class Verified:
    scored: Scored
    rank: int  # its place in the search's ranking (1 = the predicted best)
    run_dir: Path
    status: str
    tokens_per_s: Optional[float]  # measured, median after warm-up
    peak: Optional[int]  # measured max_memory_allocated (bytes); None on CPU
    device: Optional[str]


def pick(scored: list[Scored], k: int, extra: int = RANDOM_EXTRA, seed: int = 0) -> list[int]:
    """Indices into `scored` (best first): the top `k`, then `extra` others drawn at random (seeded)."""
    top = list(range(min(k, len(scored))))
    rest = list(range(len(top), len(scored)))
    return top + sorted(random.Random(seed).sample(rest, min(extra, len(rest))))


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two equally long lists (ties in either count as neither concordant nor discordant)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("kendall_tau: needs two lists of the same length, at least 2")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    n = concordant + discordant
    denom = ((n + ties_x) * (n + ties_y)) ** 0.5
    return (concordant - discordant) / denom if denom else 0.0


def write_points(result: SearchResult, recipe, picks: list[int], out: Path, steps: int) -> list[tuple[int, Path]]:
    """Per pick: its JSON and recipe (as --search writes the winner's) and a one-point sweep file running `steps`
    steps; returns (index, sweep file)."""
    sweeps = []
    for n, i in enumerate(picks):
        # the configuration in the name: the sweep runner keeps a finished run of the same name and command, so a
        # ranking that changed (another sheet or calibration) must not read another configuration's run
        name = f"{n + 1:02d}-rank{i + 1}-{config_slug(result.scored[i])}"
        where = out / "verify" / name
        ds_path, recipe_path = write_plan(result, recipe, result.scored[i], where)
        spec = {"name": f"{out.name}-verify-{name}", "recipe": str(recipe_path),
                "deepspeed": str(ds_path), "grid": {"train.max_steps": [steps]}, "launcher": {"gpus_per_run": result.world}}
        path = where / "sweep.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        sweeps.append((i, path))
    return sweeps


def config_slug(s: Scored) -> str:
    """A configuration's label as a file name: z3-off-opt+param-tp1-sp2-mb1-ga16."""
    return s.config.label().replace(" ", "-").replace(":", "-")


def measured(result: SearchResult, i: int, run_dir: Path) -> Verified:
    """What a verify run's summary.json says of configuration `i`."""
    summary = read_summary(run_dir) or {}
    metrics = summary.get("metrics") or {}
    peak_gib = metrics.get("memory/peak_allocated_gib")
    device = summary.get("device")
    return Verified(result.scored[i], i + 1, run_dir, summary.get("status", "not run"),
                    metrics.get("throughput/tokens_per_s"),
                    int(peak_gib * GIB) if peak_gib and device == "cuda" else None, device)


def run_verify(result: SearchResult, recipe, out: Path, k: int, steps: int, launcher: Optional[str],
               gpus_per_node: int, extra: int = RANDOM_EXTRA) -> list[Verified]:
    """Write, run (sweep runner) and read back the picked configurations."""
    if result.world > gpus_per_node and (launcher or "deepspeed") == "deepspeed":
        raise UserError(f"--verify: {result.world} ranks span nodes; the local launcher runs one node "
                        "(--launcher slurm)")
    rows = []
    for i, path in write_points(result, recipe, pick(result.scored, k, extra), out, steps):
        sweep = load_sweep(path)
        run_sweep(sweep, launcher=launcher)
        rows.append(measured(result, i, sweep.points[0].run_dir))
    return rows


def format_verify(rows: list[Verified]) -> str:
    """Predicted against measured, side by side, and Kendall's tau of predicted and measured tokens/s."""
    lines = ["verify: predicted against measured (measured: the run's summary.json, median after warm-up)",
             f"{'rank':>4}  {'configuration':<34} {'status':<10} {'pred tok/s':>11} {'meas tok/s':>11} {'error':>7}"
             f"  {'pred GiB':>8} {'meas GiB':>8}"]
    for r in rows:
        s = r.scored
        meas = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        err = f"{r.tokens_per_s / s.tokens_per_s - 1:+.0%}" if r.tokens_per_s else "-"
        peak = f"{r.peak / GIB:.2f}" if r.peak else ("CPU run" if r.device == "cpu" else "-")
        lines.append(f"{r.rank:>4}  {s.config.label():<34} {r.status:<10} {s.tokens_per_s:>11,.0f} {meas:>11} "
                     f"{err:>7}  {s.peak / GIB:>8.2f} {peak:>8}")
    lines.append(summary_line(rows))
    return "\n".join(lines)


def summary_line(rows: list[Verified]) -> str:
    done = [r for r in rows if r.tokens_per_s]
    if len(done) < 2:
        return f"rank correlation: needs 2 measured runs ({len(done)} measured)"
    tau = kendall_tau([r.scored.tokens_per_s for r in done], [r.tokens_per_s for r in done])
    best_measured = max(r.tokens_per_s for r in done)
    predicted_best = min(done, key=lambda r: r.rank)
    errors = sorted(abs(r.tokens_per_s / r.scored.tokens_per_s - 1) for r in done)
    return (f"Kendall tau (predicted vs measured tokens/s, {len(done)} runs): {tau:.2f}; the predicted best "
            f"(rank {predicted_best.rank}) measured {predicted_best.tokens_per_s / best_measured:.1%} of the best "
            f"measured; median |error| {statistics.median(errors):.0%}")


def calibrate(rows: list[Verified], hw_path: Path, cal_path: Path) -> Optional[str]:
    """Feed the calibration file from measured runs on the sheet's device; None (nothing written) without one.

    A GPU sheet: `efficiency.compute` scaled by the median measured/predicted tokens/s (the whole step's ratio
    put on its compute term: close where compute binds). A CPU sheet (the CPU proxy): the overhead rates fitted
    to what the measured steps took beyond the model's other terms (`memtrain.memory.overhead_fit`)."""
    hw = load_hardware(hw_path, cal_path if cal_path.is_file() else None)
    done = [r for r in rows if r.tokens_per_s and r.device == hw.device]
    if not done:
        return None
    data = yaml.safe_load(cal_path.read_text(encoding="utf-8")) if cal_path.is_file() else {}
    data = data if isinstance(data, dict) else {}
    if hw.device == "cpu":
        figures = overhead_figures(done)
        data["source"] = f"memtrain plan --verify: overhead fitted to {len(done)} measured CPU runs"
        data["overhead"] = {k: float(f"{v:.4g}") for k, v in figures.items()}
    else:
        ratio = statistics.median(r.tokens_per_s / r.scored.tokens_per_s for r in done)
        data["source"] = f"memtrain plan --verify: {len(done)} measured runs, median measured/predicted {ratio:.3f}"
        data.setdefault("efficiency", {})["compute"] = round(hw.compute_efficiency * ratio, 4)
    cal_path.parent.mkdir(parents=True, exist_ok=True)
    cal_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    load_hardware(hw_path, cal_path)  # the file must load over its sheet
    changed = data["overhead"] if hw.device == "cpu" else {"efficiency.compute": data["efficiency"]["compute"]}
    return f"{cal_path}: {', '.join(f'{k} {v:g}' for k, v in changed.items())} ({data['source']})"


def overhead_figures(done: list[Verified]) -> dict[str, float]:
    """The overhead rates that fit the measured step seconds beyond the model's other terms."""
    extra = []
    for r in done:
        measured_s = r.scored.time.seconds * r.scored.tokens_per_s / r.tokens_per_s
        extra.append(measured_s - (r.scored.time.seconds - r.scored.time.terms.get("overhead", 0.0)))
    return fit_overheads([r.scored.time.counts for r in done], extra)


def verify_cli(args, result: SearchResult, recipe, hw, out: Path) -> None:
    """--verify K: run the picked configurations, print predicted against measured, feed the calibration file."""
    rows = run_verify(result, recipe, out, args.verify, args.verify_steps, args.launcher, hw.gpus_per_node)
    print(format_verify(rows))
    cal = Path(args.calibration) if args.calibration else calibration_path(Path(args.hardware))
    line = calibrate(rows, Path(args.hardware), cal)
    print(line or f"calibration: not changed (no measured {hw.device} run: runs calibrate a sheet of their own device)")


def check_verify_args(args, warmup_steps: int) -> None:
    """Before the search: --verify's numbers make sense (tokens/s is measured only after the metric warm-up)."""
    if args.verify < 0:
        raise UserError("--verify K: K must be >= 0")
    if args.verify and args.verify_steps <= warmup_steps + 1:
        raise UserError(f"--verify-steps {args.verify_steps}: needs more than train.metric_warmup_steps + 1 "
                        f"({warmup_steps + 1}): tokens/s is measured after the warm-up")

"""`make plan ARGS="--search ... --verify K"`: run the top K configurations (and a few random feasible ones) for a few
steps through the sweep runner, and print predicted against measured tokens/s and peak memory with their rank
correlation (Kendall's tau).

Each configuration runs `--verify-repeats` times, interleaved (every configuration once per round, rounds alternating
forward and back: a load that drifts through the rounds weighs on every configuration alike), and its measured figure
is the median of its runs; the spread of its runs is the noise, and pairs whose runs overlap count as measured ties.

Each configuration is written as `plans/<name>/verify/<i>/ds.json` + `recipe.yaml` (what `--search` writes for its
winner) and a one-point sweep file beside them, run by `memtrain.tools.sweep.run_sweep` with the local launcher
(`deepspeed`, one process per GPU, or gloo ranks on a CPU machine) or Slurm (`--launcher slurm`). The measured figures
are the runs' own summary.json: `throughput/tokens_per_s` (median after warm-up) and `memory/peak_allocated_gib`
(CUDA's allocator; a CPU run has none). Measured runs on the sheet's device feed its calibration file: each
configuration becomes a point appended to the file's earlier ones (`memtrain.memory.calibration_points`), and the
figures are fitted again on every point of the sheet: a GPU sheet's `efficiency.compute` (the median of the
points' measured over predicted, put on compute); a CPU sheet's (the CPU proxy) overhead rates and intra-node link
rate, fitted to the measured steps.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import yaml

from memtrain.errors import UserError
from memtrain.memory.score import Scored
from memtrain.memory.search import SearchResult
from memtrain.units import GIB
from memtrain.memory.calibration_points import Point, fit_cpu, pooled, pooled_efficiency, read_points, to_yaml
from memtrain.memory.hardware import Hardware, calibration_path, load_hardware
from memtrain.tools.plan_search import write_plan
from memtrain.tools.sweep import run_sweep
from memtrain.tools.sweep_points import RunDir, load_sweep, read_summary

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
    samples: tuple[float, ...] = ()  # every repeat's measured tokens/s (tokens_per_s is their median)
    date: str = ""  # when its (last) run finished, UTC: its summary.json's time

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats' tokens/s: 0 for one run."""
        return (max(self.samples) - min(self.samples)) / self.tokens_per_s if len(self.samples) > 1 else 0.0

    def overlaps(self, other: "Verified") -> bool:
        """Whether the two configurations' measured ranges (min..max over the repeats) overlap: a tie within noise."""
        if len(self.samples) < 2 or len(other.samples) < 2:
            return False
        return min(self.samples) <= max(other.samples) and min(other.samples) <= max(self.samples)


def run_order(n: int, repeats: int) -> list[tuple[int, int]]:
    """(repeat, pick) in the order the runs go: every pick once per round, odd rounds backwards (ABC CBA ABC), so
    a load drifting linearly over two rounds weighs the same on every pick."""
    return [(j, p) for j in range(repeats) for p in (range(n) if j % 2 == 0 else reversed(range(n)))]


def pick(scored: list[Scored], k: int, extra: int = RANDOM_EXTRA, seed: int = 0) -> list[int]:
    """Indices into `scored` (best first): the top `k`, then `extra` others drawn at random (seeded)."""
    top = list(range(min(k, len(scored))))
    rest = list(range(len(top), len(scored)))
    return top + sorted(random.Random(seed).sample(rest, min(extra, len(rest))))


def kendall_tau(xs: list[float], ys: list[float], tied_y=None) -> float:
    """Kendall's tau-b of two equally long lists (ties in either count as neither concordant nor discordant);
    `tied_y(i, j)`, when given, also makes pair (i, j) a tie in `ys` (a measured difference within noise)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("kendall_tau: needs two lists of the same length, at least 2")
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if tied_y is not None and tied_y(i, j):
                dy = 0
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


def write_points(result: SearchResult, recipe, picks: list[int], out: Path, steps: int,
                 repeats: int = 1) -> list[tuple[int, list[Path]]]:
    """Per pick: its JSON and recipe (as --search writes the winner's) and one one-point sweep file per repeat
    running `steps` steps (each its own run directory) and saving no model checkpoint (a 1B model's run would
    write ~18 GB of ZeRO states nobody reads); returns (index, sweep files)."""
    sweeps = []
    for n, i in enumerate(picks):
        # the configuration in the name: the sweep runner keeps a finished run of the same name and command, so a
        # ranking that changed (another sheet or calibration) must not read another configuration's run
        name = f"{n + 1:02d}-rank{i + 1}-{config_slug(result.scored[i])}"
        where = out / "verify" / name
        ds_path, recipe_path = write_plan(result, recipe, result.scored[i], where)
        paths = []
        for j in range(repeats):
            spec = {"name": f"{out.name}-verify-{name}-r{j + 1}", "recipe": str(recipe_path), "deepspeed": str(ds_path),
                    "grid": {"train.max_steps": [steps], "train.save_checkpoints": [False]},
                    "launcher": {"gpus_per_run": result.world}}
            paths.append(where / f"sweep-r{j + 1}.yaml")
            paths[-1].write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        sweeps.append((i, paths))
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
                    int(peak_gib * GIB) if peak_gib and device == "cuda" else None, device, date=finished(run_dir))


def finished(run_dir: Path) -> str:
    """When a run wrote its summary.json (UTC, to the minute); '' without one."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(RunDir(run_dir).summary_file.stat().st_mtime))
    except OSError:
        return ""


def combined(runs: list[Verified]) -> Verified:
    """One configuration's repeats as one row: the median of the measured tokens/s, every run's kept in `samples`."""
    done = [r for r in runs if r.tokens_per_s]
    first = (done or runs)[0]
    status = first.status if len(done) == len(runs) else f"{len(done)}/{len(runs)} done"
    if not done:
        return replace(first, status=status)
    samples = tuple(r.tokens_per_s for r in done)
    peaks = [r.peak for r in done if r.peak]
    return replace(first, status=status, tokens_per_s=statistics.median(samples), samples=samples,
                   peak=max(peaks) if peaks else None, date=max(r.date for r in done))


def run_verify(result: SearchResult, recipe, out: Path, k: int, steps: int, launcher: Optional[str],
               gpus_per_node: int, extra: int = RANDOM_EXTRA, repeats: int = 1) -> list[Verified]:
    """Write, run (sweep runner; the repeats interleaved, run_order) and read back the picked configurations.
    After each run the table so far goes to `out`/verify/verify.md, so a call cut short (a GPU lease's time) keeps
    what it measured; a second call with the same command keeps the finished runs and goes on."""
    if result.world > gpus_per_node and (launcher or "deepspeed") == "deepspeed":
        raise UserError(f"--verify: {result.world} ranks span nodes; the local launcher runs one node "
                        "(--launcher slurm)")
    points = write_points(result, recipe, pick(result.scored, k, extra), out, steps, repeats)
    runs: list[list[Verified]] = [[] for _ in points]
    order = run_order(len(points), repeats)
    for n, (j, p) in enumerate(order):
        i, paths = points[p]
        sweep = load_sweep(paths[j])
        run_sweep(sweep, launcher=launcher)
        runs[p].append(measured(result, i, sweep.points[0].run_dir))
        so_far = [combined(r) if r else not_run(result, i) for r, (i, _) in zip(runs, points)]
        (out / "verify" / "verify.md").write_text(f"{n + 1} of {len(order)} runs done\n\n{format_verify(so_far)}\n",
                                                  encoding="utf-8")
    return [combined(r) for r in runs]


def not_run(result: SearchResult, i: int) -> Verified:
    """A picked configuration none of whose runs has finished yet."""
    return Verified(result.scored[i], i + 1, Path(), "not run", None, None, None)


def format_verify(rows: list[Verified]) -> str:
    """Predicted against measured, side by side, and Kendall's tau of predicted and measured tokens/s."""
    lines = ["verify: predicted against measured (measured: the run's summary.json, median after warm-up)",
             f"{'rank':>4}  {'configuration':<34} {'status':<10} {'pred tok/s':>11} {'meas tok/s':>11} {'spread':>7}"
             f" {'error':>7}  {'pred GiB':>8} {'meas GiB':>8}"]
    for r in rows:
        s = r.scored
        meas = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        err = f"{r.tokens_per_s / s.tokens_per_s - 1:+.0%}" if r.tokens_per_s else "-"
        peak = f"{r.peak / GIB:.2f}" if r.peak else ("CPU run" if r.device == "cpu" else "-")
        spread = f"{r.spread:.1%}" if len(r.samples) > 1 else "-"
        lines.append(f"{r.rank:>4}  {s.config.label():<34} {r.status:<10} {s.tokens_per_s:>11,.0f} {meas:>11} "
                     f"{spread:>7} {err:>7}  {s.peak / GIB:>8.2f} {peak:>8}")
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
    line = (f"Kendall tau (predicted vs measured tokens/s, {len(done)} configurations): {tau:.2f}; the predicted best "
            f"(rank {predicted_best.rank}) measured {predicted_best.tokens_per_s / best_measured:.1%} of the best "
            f"measured; median |error| {statistics.median(errors):.0%}")
    return line + noise_line(done)


def noise_line(done: list[Verified]) -> str:
    """The repeats' spread and the tau that counts pairs whose measured ranges overlap as ties ('' for one run)."""
    repeated = [r for r in done if len(r.samples) > 1]
    if not repeated:
        return ""
    spreads = sorted(r.spread for r in repeated)
    ties = sum(done[i].overlaps(done[j]) for i in range(len(done)) for j in range(i + 1, len(done)))
    tau = kendall_tau([r.scored.tokens_per_s for r in done], [r.tokens_per_s for r in done],
                      tied_y=lambda i, j: done[i].overlaps(done[j]))
    return (f"\nnoise: {min(len(r.samples) for r in repeated)}+ runs each, interleaved; spread (max-min)/median "
            f"{statistics.median(spreads):.1%} median, {spreads[-1]:.1%} max; {ties} pairs within noise (their runs' "
            f"ranges overlap); Kendall tau with those pairs as measured ties: {tau:.2f}")


def calibrate(rows: list[Verified], hw_path: Path, cal_path: Path) -> Optional[str]:
    """Append the runs measured on the sheet's device to the calibration file's points and fit its figures again on
    every point of this sheet (`memtrain.memory.calibration_points`); None (nothing written) without such a run.

    A GPU sheet: `efficiency.compute`, the median over the points of the sheet's efficiency scaled by measured over
    predicted tokens/s (the whole step's ratio put on its compute term: close where compute binds). A CPU sheet
    (the CPU proxy, nothing hidden): the overhead rates and the intra-node link's rate, fitted to what the measured
    steps took beyond the model's other terms, in errors relative to each step."""
    hw = load_hardware(hw_path, cal_path if cal_path.is_file() else None)
    done = [r for r in rows if r.tokens_per_s and r.device == hw.device]
    if not done:
        return None
    data = yaml.safe_load(cal_path.read_text(encoding="utf-8")) if cal_path.is_file() else {}
    data = data if isinstance(data, dict) else {}
    points = pooled(read_points(data.pop("points", None), cal_path), [point_of(r, hw) for r in done])
    mine = [p for p in points if (p.sheet, p.device) == (hw.name, hw.device)]
    what = f"{len(mine)} points of {hw.name} ({len(done)} from this round)"
    if hw.device == "cpu":
        changed = cpu_figures(data, mine, hw, what)
    else:
        efficiency = round(pooled_efficiency(mine), 4)
        data["source"] = f"memtrain plan --verify: efficiency.compute, the median over {what}"
        data.setdefault("efficiency", {})["compute"] = efficiency
        changed = {"efficiency.compute": efficiency}
    data["points"] = [to_yaml(p) for p in points]
    cal_path.parent.mkdir(parents=True, exist_ok=True)
    cal_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    load_hardware(hw_path, cal_path)  # the file must load over its sheet
    return f"{cal_path}: {', '.join(f'{k} {v:g}' for k, v in changed.items()) or 'figures unchanged'} ({data['source']})"


def cpu_figures(data: dict, points: list[Point], hw: Hardware, what: str) -> dict:
    """Into the calibration file's `data`: the overhead rates and the link's rate fitted to `points`; unchanged with
    too few points (they wait for the next round). Returns the figures it set."""
    fitted = fit_cpu(points, 1.0 / hw.intra_bytes_per_s)
    if fitted is None:
        data["source"] = f"memtrain plan --verify: {what}; too few to fit the overhead (3 needed)"
        return {}
    overhead, link = fitted
    data["source"] = f"memtrain plan --verify: overhead{' and intra-node link' if link else ''} fitted to {what}"
    changed = {k: float(f"{v:.4g}") for k, v in overhead.items()}
    data.setdefault("overhead", {}).update(changed)  # figures the fit does not set (host_op_s) stay as they were
    if link:
        data.setdefault("gpu", {})["intra_node_gb_per_s"] = float(f"{link / 1e9:.4g}")
        data.setdefault("efficiency", {})["intra_node_link"] = 1.0  # the fitted rate is what a call reaches
        changed = {**changed, "gpu.intra_node_gb_per_s": data["gpu"]["intra_node_gb_per_s"]}
    return changed


def point_of(r: Verified, hw: Hardware) -> Point:
    """A measured configuration as a calibration point: its median step, and the model's terms under `hw` (the
    figures it was scored with) beside the overhead and the intra-node link's bytes, which the CPU fit refits (on a
    GPU, where overlap hides part of the bytes, `base_s` is not used)."""
    t = r.scored.time
    measured_s = t.seconds * r.scored.tokens_per_s / r.tokens_per_s
    base = t.seconds - t.terms.get("overhead", 0.0) - t.intra_s
    return Point(r.scored.config.label(), hw.name, hw.device, r.date or time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                 measured_s, r.spread, max(len(r.samples), 1), base,
                 hw.compute_efficiency * t.seconds / measured_s, {**t.counts, "intra_bytes": t.intra_bytes})


def verify_cli(args, result: SearchResult, recipe, hw, out: Path) -> None:
    """--verify K: run the picked configurations, print predicted against measured, feed the calibration file."""
    rows = run_verify(result, recipe, out, args.verify, args.verify_steps, args.launcher, hw.gpus_per_node,
                      extra=args.verify_extra, repeats=args.verify_repeats)
    print(format_verify(rows))
    cal = Path(args.calibration) if args.calibration else calibration_path(Path(args.hardware))
    line = calibrate(rows, Path(args.hardware), cal)
    print(line or f"calibration: not changed (no measured {hw.device} run: runs calibrate a sheet of their own device)")


def check_verify_args(args, warmup_steps: int) -> None:
    """Before the search: --verify's numbers make sense (tokens/s is measured only after the metric warm-up)."""
    if args.verify < 0:
        raise UserError("--verify K: K must be >= 0")
    if args.verify_repeats < 1:
        raise UserError(f"--verify-repeats {args.verify_repeats}: must be >= 1")
    if args.verify_extra < 0:
        raise UserError(f"--verify-extra {args.verify_extra}: must be >= 0")
    if args.verify and args.verify_steps <= warmup_steps + 1:
        raise UserError(f"--verify-steps {args.verify_steps}: needs more than train.metric_warmup_steps + 1 "
                        f"({warmup_steps + 1}): tokens/s is measured after the warm-up")

"""`make report`: a sweep's runs gathered into tables and plots under `reports/<sweep>/`.

Metrics come from each run's TensorBoard files, read with tensorboard's own reader; the run's
`summary.json` gives only its status and, for a failure, the reason. A metric's value is its
median over the steps after warm-up: the steps that carry throughput figures (the trainer logs
none during warm-up). The final loss is the last logged `train/loss`.
"""
from __future__ import annotations

import csv
import json
import statistics
import textwrap
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import ArgumentParser, UserError, cli_entry
from memtrain.tools.sweep_points import (DEFAULT_SWEEP, DS_KEY, Point, Sweep, add_shrink_flags, load_sweep, read_summary,
                                         short_names)
from memtrain.tools.tb import read_scalars
from memtrain.train.run_dir import RunDir
from memtrain.units import GIB, parse_size
from memtrain.tools.report_seq import plot_vs_seq_len

POLICY_KEY = "activation_checkpointing.policy"
AFTER_WARMUP_TAG = "throughput/tokens_per_s"  # logged only after warm-up
# column, TensorBoard tag, summary.md header, format
METRICS = [
    ("tokens_per_s", "throughput/tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tflops_per_device", "throughput/tflops_per_device", "TFLOP/s per device", "{:.3g}"),
    ("mfu", "throughput/mfu", "MFU", "{:.1%}"),
    ("step_s", "time/step_s", "step s", "{:.3g}"),
    ("peak_allocated_gib", "memory/peak_allocated_gib", "peak allocated GiB", "{:.3g}"),
    ("peak_reserved_gib", "memory/peak_reserved_gib", "peak reserved GiB", "{:.3g}"),
    ("predicted_peak_gib", "memory/predicted_peak_gib", "predicted peak GiB", "{:.3g}"),
    ("activation_gib", "memory/activation_gib", "activation GiB", "{:.3g}"),
    ("host_rss_gib", "memory/host_rss_gib", "host RSS GiB", "{:.3g}"),
]
MEMORY_AXES = {  # the memory a point is placed by and budgeted against; device memory where measured
    "peak_allocated_gib": "peak allocated device memory per rank",
    "activation_gib": "activation memory saved for backward per rank",
}


# --------------------------------------------------------------------------- gathering

def after_warmup_medians(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Median of every tag over the steps after warm-up (all logged steps if none got that far)."""
    measured = {step for step, _ in scalars.get(AFTER_WARMUP_TAG, [])}
    out = {}
    for tag, series in scalars.items():
        values = [v for step, v in series if not measured or step in measured]
        if values:
            out[tag] = statistics.median(values)
    return out


def _display(key: str, value: Any) -> str:
    return Path(value).stem if key == DS_KEY else str(value)


def point_row(point: Point, names: dict[str, str]) -> dict[str, Any]:
    summary = read_summary(point.run_dir)
    status = summary.get("status", "unknown") if summary else ("incomplete" if point.run_dir.exists() else "not run")
    tb = RunDir(point.run_dir).tensorboard
    scalars = read_scalars(tb) if tb.is_dir() else {}
    medians = after_warmup_medians(scalars)
    row: dict[str, Any] = {"point": point.id}
    row.update({names[k]: _display(k, v) for k, v in point.values.items()})
    row["status"] = status
    row.update({col: medians.get(tag) for col, tag, _, _ in METRICS})
    loss = scalars.get("train/loss")
    row["final_loss"] = loss[-1][1] if loss else None
    row["eval_curve"] = scalars.get("eval/loss", [])  # (step, held-out loss) per eval
    row["eval_loss"] = row["eval_curve"][-1][1] if row["eval_curve"] else None
    row["steps"] = loss[-1][0] if loss else (summary or {}).get("steps")
    row["pareto"] = False
    row["reason"] = (summary or {}).get("reason") or ""
    row["policy"] = str(point.values.get(POLICY_KEY) or _effective_policy(point.run_dir) or "?")
    return row


def _effective_policy(run_dir: Path) -> Optional[str]:
    for path in (RunDir(run_dir).summary_file, RunDir(run_dir).config_file):
        try:
            return json.loads(path.read_text())["ac_plan"]["policy"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            continue
    return None


def memory_axis(rows: list[dict]) -> str:
    """Device peak memory where it was measured; on CPU (no device memory) activation memory."""
    if any(r["status"] == "completed" and (r["peak_allocated_gib"] or 0) > 0 for r in rows):
        return "peak_allocated_gib"
    return "activation_gib"


def _plottable(rows: list[dict], mem: str) -> list[dict]:
    return [r for r in rows if r["status"] == "completed" and r[mem] is not None and r["tokens_per_s"] is not None]


def pareto_front(rows: list[dict], mem: str) -> set[str]:
    """Points no other completed point beats on both memory (lower) and tokens/s (higher)."""
    pts = _plottable(rows, mem)
    return {r["point"] for r in pts if not any(
        q[mem] <= r[mem] and q["tokens_per_s"] >= r["tokens_per_s"]
        and (q[mem] < r[mem] or q["tokens_per_s"] > r["tokens_per_s"]) for q in pts)}


def best_line(rows: list[dict], mem: str, budget: Optional[float]) -> str:
    pts = _plottable(rows, mem)
    what = MEMORY_AXES[mem]
    fits = [r for r in pts if budget is None or r[mem] <= budget]
    head = f"**Best point under BUDGET={budget:.4g} GiB** ({what})" if budget is not None else \
        "**Fastest point** (no BUDGET= given)"
    if not pts:
        return f"{head}: none, no point has completed yet."
    if not fits:
        least = min(pts, key=lambda r: r[mem])
        return f"{head}: no completed point fits; the smallest needs {least[mem]:.4g} GiB (`{least['point']}`)."
    best = max(fits, key=lambda r: r["tokens_per_s"])
    return f"{head}: `{best['point']}` at {best['tokens_per_s']:,.0f} tokens/s, {best[mem]:.4g} GiB."


def gather(sweep: Sweep) -> tuple[list[dict], str]:
    names = short_names(list(sweep.points[0].values))
    rows = [point_row(p, names) for p in sweep.points]
    mem = memory_axis(rows)
    front = pareto_front(rows, mem)
    for r in rows:
        r["pareto"] = r["point"] in front
    return rows, mem


# --------------------------------------------------------------------------- tables

def write_csv(rows: list[dict], swept: list[str], path: Path) -> None:
    cols = ["point", *swept, "status", "steps", *[c for c, *_ in METRICS], "final_loss", "eval_loss", "pareto",
            "reason"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


def _cell(value: Any, fmt: str = "{}") -> str:
    if value is None or value == "":
        return ""
    return fmt.format(value).replace("|", "\\|")


def write_markdown(sweep: Sweep, rows: list[dict], swept: list[str], mem: str, budget: Optional[float],
                   path: Path) -> None:
    # Columns with nothing measured in any row (MFU on CPU, device memory on CPU) are left out.
    metrics = [(c, h, f) for c, _, h, f in METRICS if any(r[c] for r in rows)]
    reasons = any(r["reason"] for r in rows)
    held_out = any(r["eval_loss"] is not None for r in rows)  # a column only where some point evaluated
    header = [*swept, "status", *[h for _, h, _ in metrics], "final loss", *(["eval loss"] if held_out else []),
              "Pareto", *(["reason"] if reasons else [])]
    lines = [
        best_line(rows, mem, budget), "",
        f"# Sweep `{sweep.name}` ({sweep.path})", "",
        "Medians over the steps after warm-up, read from each run's TensorBoard files; final loss is the "
        "last logged loss" + (", eval loss the last held-out loss (eval_loss.png: its curves)" if held_out else "")
        + f". Pareto ✓: no other completed point is faster with no more {MEMORY_AXES[mem]}, "
        "or as fast with less." + (" No device memory was measured (CPU runs): points are placed and budgeted by "
                                   "activation memory." if mem == "activation_gib" else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if h in swept or h in ("status", "reason", "Pareto") else "--:" for h in header) + "|",
    ]
    for r in rows:
        reason = r["reason"] if len(r["reason"]) <= 160 else r["reason"][:157] + "..."
        cells = [*[_cell(r[k]) for k in swept], r["status"], *[_cell(r[c], f) for c, _, f in metrics],
                 _cell(r["final_loss"], "{:.4f}"), *([_cell(r["eval_loss"], "{:.4f}")] if held_out else []),
                 "✓" if r["pareto"] else "", *([_cell(reason)] if reasons else [])]
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- plots
# Colour (plot 1) and x group (plot 2) = the AC policy; marker (plot 1) and bar shade (plot 2) = the
# row's other swept values ("variant"). Points that did not complete are listed under each plot.

MARKERS = "osD^vP*Xh<>p"


def _variant(row: dict, swept: list[str]) -> str:
    return ", ".join(f"{k}={row[k]}" for k in swept if k not in ("policy", POLICY_KEY))


def _figure(rows: list[dict], swept: list[str]):
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, kept off --help

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, kept off --help

    fig, ax = plt.subplots(figsize=(10, 5.5))
    return fig, ax, any(r["status"] != "completed" for r in rows)


def _list_failures(ax, rows: list[dict], swept: list[str]) -> None:
    """Under the x-axis label (so never over tick labels): one line per point that did not complete."""
    lines = []
    for r in rows:
        if r["status"] != "completed":
            label = ", ".join(f"{k}={r[k]}" for k in swept)
            lines += textwrap.wrap(f"× {label}: {r['status']}" + (f" — {r['reason']}" if r["reason"] else ""),
                                   width=120, subsequent_indent="     ", max_lines=2, placeholder=" ...")
    if lines:
        ax.annotate("Points that did not complete:\n" + "\n".join(lines), xy=(0, 0),
                    xycoords=("axes fraction", ax.xaxis.label), xytext=(0, -10), textcoords="offset points",
                    va="top", ha="left", fontsize=8.5, color="darkred")


def _save(fig, ax, rows: list[dict], swept: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, kept off --help

    _list_failures(ax, rows, swept)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _failed_marker(label: str):
    from matplotlib.lines import Line2D  # noqa: PLC0415 matplotlib: heavy, kept off --help

    return Line2D([], [], ls="", marker="x", ms=9, color="red", mew=2, label=label)


def plot_throughput_vs_memory(sweep: Sweep, rows: list[dict], swept: list[str], mem: str, budget: Optional[float],
                              path: Path) -> None:
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, kept off --help
    from matplotlib.lines import Line2D  # noqa: PLC0415 matplotlib: heavy, kept off --help

    fig, ax, any_failed = _figure(rows, swept)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    cmap = matplotlib.colormaps["tab10" if len(policies) <= 10 else "tab20"]
    color = {p: cmap(i % cmap.N) for i, p in enumerate(policies)}
    variants = list(dict.fromkeys(_variant(r, swept) for r in rows))
    marker = {v: MARKERS[i % len(MARKERS)] for i, v in enumerate(variants)}
    pts = _plottable(rows, mem)
    for r in pts:
        ax.scatter(r[mem], r["tokens_per_s"], s=70, color=color[r["policy"]], marker=marker[_variant(r, swept)],
                   edgecolors="black", linewidths=0.6, zorder=3)
    front = sorted((r for r in pts if r["pareto"]), key=lambda r: r[mem])
    if front:  # a staircase: the best tokens/s reachable within each amount of memory
        xs, ys = [r[mem] for r in front], [r["tokens_per_s"] for r in front]
        right = max(r[mem] for r in pts)  # more memory than the last front point buys nothing faster
        ax.plot([*xs, right], [*ys, ys[-1]], "k--", drawstyle="steps-post", lw=1.2, zorder=2)
        ax.scatter(xs, ys, s=180, facecolors="none", edgecolors="black", linewidths=1.2, zorder=2)
    failed = [r for r in rows if r["status"] != "completed" and r[mem] is not None]
    ax.scatter([r[mem] for r in failed], [0] * len(failed), marker="x", s=90, color="red", linewidths=2, zorder=4,
               clip_on=False, transform=ax.get_xaxis_transform())  # on the x-axis, at the memory it measured
    ax.set_xlabel(f"{MEMORY_AXES[mem]}, median after warm-up (GiB)")
    ax.set_ylabel("throughput, median after warm-up (tokens/s, all ranks)")
    ax.set_title(f"{sweep.name}: throughput vs memory ({len(pts)} of {len(rows)} points completed)"
                 + _spread(pts, mem))
    # from zero: a few per cent of noise looks like a few per cent, not like the whole axis
    xs = [r[mem] for r in pts + failed] + ([budget] if budget is not None else [])
    ax.set_xlim(0, 1.08 * max(xs, default=1) or 1)
    ax.set_ylim(0, 1.08 * max((r["tokens_per_s"] for r in pts), default=1) or 1)
    ax.grid(alpha=0.3)
    ax.yaxis.set_major_formatter("{x:,.0f}")
    plotted = {r["policy"] for r in pts}
    by_policy = [Line2D([], [], ls="", marker="o", ms=8, color=c, markeredgecolor="black", label=p)
                 for p, c in color.items() if p in plotted]
    ax.add_artist(ax.legend(handles=by_policy, title="AC policy", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                            fontsize=9, title_fontsize=9))
    keys = [Line2D([], [], ls="", marker=marker[v], ms=8, color="grey", markeredgecolor="black", label=v)
            for v in variants if v and any(_variant(r, swept) == v for r in pts)]
    keys.append(Line2D([], [], ls="--", color="black", marker="o", ms=12, markerfacecolor="none", label="Pareto front"))
    if budget is not None:
        keys.append(ax.axvline(budget, color="firebrick", ls=":", lw=1.5, label=f"BUDGET={budget:.4g} GiB"))
    if any_failed:
        keys.append(_failed_marker("did not complete (listed below)"))
    ax.legend(handles=keys, loc="lower left", bbox_to_anchor=(1.02, 0.0), fontsize=9)
    _save(fig, ax, rows, swept, path)


def _spread(pts: list[dict], mem: str) -> str:
    """The title's second line: how far apart the completed points are, largest over smallest."""
    def ratio(key: str) -> str:
        values = [r[key] for r in pts if r[key]]
        return f"{max(values) / min(values):.2f}×" if values else "n/a"

    return f"\nlargest / smallest: tokens/s {ratio('tokens_per_s')}, memory {ratio(mem)}" if len(pts) > 1 else ""


def plot_activation_memory(sweep: Sweep, rows: list[dict], swept: list[str], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, kept off --help
    from matplotlib.patches import Patch  # noqa: PLC0415 matplotlib: heavy, kept off --help

    fig, ax, any_failed = _figure(rows, swept)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    variants = list(dict.fromkeys(_variant(r, swept) for r in rows))
    cmap = matplotlib.colormaps["viridis"]
    shade = {v: cmap(0.15 + 0.7 * i / max(len(variants) - 1, 1)) for i, v in enumerate(variants)}
    width = 0.8 / len(variants)
    for r in rows:
        vi = variants.index(_variant(r, swept))
        x = policies.index(r["policy"]) - 0.4 + width * (vi + 0.5)
        if r["status"] == "completed" and r["activation_gib"] is not None:
            bar = ax.bar(x, r["activation_gib"], width * 0.9, color=shade[variants[vi]], edgecolor="black", lw=0.5)
            if len(rows) <= 16:  # values on the bars while they have room for them
                ax.bar_label(bar, fmt="{:.3g}", fontsize=8, padding=2)
        else:
            ax.scatter(x, 0, marker="x", s=80, color="red", linewidths=2, zorder=4, clip_on=False)
    many = len(policies) > 6
    ax.set_xticks(range(len(policies)), policies, rotation=30 if many else 0, ha="right" if many else "center")
    ax.set_xlabel("activation checkpointing policy")
    ax.set_ylabel("activation memory saved for backward\nper rank, median after warm-up (GiB)")
    ax.set_title(f"{sweep.name}: activation memory per policy")
    ax.margins(y=0.12)  # room for the bar labels
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    keys = [Patch(facecolor=shade[v], edgecolor="black", label=v) for v in variants if v]
    if any_failed:
        keys.append(_failed_marker("did not complete (listed below)"))
    if keys:
        ax.legend(handles=keys, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9)
    _save(fig, ax, rows, swept, path)


def plot_eval_loss(sweep: Sweep, rows: list[dict], swept: list[str], path: Path) -> bool:
    """The held-out loss against the step, one line per point that evaluated; False (no file) when none did."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, kept off --help
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 matplotlib: heavy, kept off --help

    curves = [r for r in rows if r["eval_curve"]]
    if not curves:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in curves:
        steps, losses = zip(*r["eval_curve"])
        label = ", ".join(f"{k}={r[k]}" for k in swept) or r["point"]
        ax.plot(steps, losses, marker="o", ms=3, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per token)")
    ax.set_title(f"{sweep.name}: eval loss per point")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- command line

def write_report(sweep: Sweep, budget: Optional[float] = None, out_root: Path = Path("reports")) -> Path:
    rows, mem = gather(sweep)
    if all(r["status"] == "not run" for r in rows):  # empty tables and plots with meaningless axes: nothing to show
        raise UserError(f"{sweep.path}: no point of sweep '{sweep.name}' has run ({sweep.runs_dir} holds none of its "
                        f"{len(rows)} points); run them first: make sweep SWEEP={sweep.path}")
    out = out_root / sweep.name
    out.mkdir(parents=True, exist_ok=True)
    swept = list(short_names(list(sweep.points[0].values)).values())
    write_csv(rows, swept, out / "summary.csv")
    write_markdown(sweep, rows, swept, mem, budget, out / "summary.md")
    plot_throughput_vs_memory(sweep, rows, swept, mem, budget, out / "throughput_vs_memory.png")
    plot_activation_memory(sweep, rows, swept, out / "activation_memory.png")

    plot_vs_seq_len(sweep, rows, short_names(list(sweep.points[0].values)), mem, MEMORY_AXES[mem],
                    out / "seq_len.png")
    if not plot_eval_loss(sweep, rows, swept, out / "eval_loss.png"):
        (out / "eval_loss.png").unlink(missing_ok=True)  # an earlier report's: no point evaluated now
    return out


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", nargs="?", default=DEFAULT_SWEEP, help=f"sweep file (default: {DEFAULT_SWEEP})")
    p.add_argument("--budget", help="memory budget for the best-point line, e.g. 40GiB")
    add_shrink_flags(p)
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    budget = parse_size(args.budget, 'BUDGET') / GIB if args.budget else None
    sweep = load_sweep(args.sweep, args.set, args.grid)
    out = write_report(sweep, budget)
    print((out / "summary.md").read_text().splitlines()[0])
    extra = "".join(f", {name}" for name in ("seq_len.png", "eval_loss.png") if (out / name).exists())
    print(f"report: {out}/summary.md, summary.csv, throughput_vs_memory.png, activation_memory.png{extra}")


if __name__ == "__main__":
    main()

"""`make report` for a sweep over `data.seq_len`: tokens/s and peak memory against sequence length
(seq_len.png), one line per combination of the other swept values."""
from __future__ import annotations

from pathlib import Path

SEQ_KEY = "data.seq_len"


def plot_vs_seq_len(sweep, rows: list[dict], names: dict[str, str], mem: str, mem_label: str, path: Path) -> bool:
    """Two panels sharing the x axis (log2 sequence length); False when the sweep has no seq_len axis."""
    if SEQ_KEY not in names:
        return False
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, imported only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, imported only when this runs

    seq_col = names[SEQ_KEY]
    others = [c for k, c in names.items() if k != SEQ_KEY]
    series: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{c}={r[c]}" for c in others) or "run"
        series.setdefault(label, []).append(r)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    failed = []
    for label, pts in series.items():
        ok = sorted((int(p[seq_col]), p) for p in pts if p["status"] == "completed" and p["tokens_per_s"] is not None)
        failed += [f"{label}, {seq_col}={p[seq_col]}: {p['status']}" for p in pts if p["status"] != "completed"]
        if not ok:
            continue
        xs = [s for s, _ in ok]
        line, = top.plot(xs, [p["tokens_per_s"] for _, p in ok], "o-", label=label)
        ys = [p[mem] for _, p in ok]
        if all(y is not None for y in ys):
            bottom.plot(xs, ys, "o-", color=line.get_color(), label=label)
    top.set_ylabel("tokens/s (median after warm-up)")
    bottom.set_ylabel(f"{mem_label} (GiB)")
    bottom.set_xlabel("sequence length (tokens)")
    bottom.set_xscale("log", base=2)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.1 * ax.get_ylim()[1])  # from zero: noise between points stays as small as it is
    top.set_title(f"{sweep.name}: throughput and memory against sequence length")
    top.legend(fontsize=8, loc="best")
    if failed:
        fig.text(0.01, 0.005, "did not complete: " + "; ".join(failed[:6]), fontsize=7, color="red")
    fig.tight_layout(rect=(0, 0.03 if failed else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""The benchmark's report: one markdown table, plus the issue's targets checked against it."""
from __future__ import annotations

from typing import Optional

from .setups import BASELINE

COLUMNS = ("set-up", "what", "micro-batch", "tokens/s", "x no-AC", "peak GiB", "activation GiB",
           "offloaded GiB", "forward-retained GiB", "largest micro-batch")


def _num(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _largest(search: Optional[dict]) -> str:
    if not search:
        return "not searched"
    fits, oom = search.get("fits"), search.get("oom_at")
    if fits is None:
        return f"none (OOM at {oom})"
    return f"{fits} (OOM at {oom})" if oom else f">= {fits} (limit)"


def markdown(results: list[dict], searches: dict[str, dict]) -> str:
    base = next((r for r in results if r["setup"] == BASELINE and not r.get("oom") and "tokens_per_s" in r), None)
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if r.get("oom") or "tokens_per_s" not in r:
            status = "OOM" if r.get("oom") else "skipped" if r.get("skipped") else "failed"
            cells = [r["setup"], r["label"], str(r["micro_batch"]), status]
            cells += [""] * (len(COLUMNS) - len(cells) - 1) + [_largest(searches.get(r["setup"]))]
        else:
            same = base is not None and base["micro_batch"] == r["micro_batch"]
            cells = [r["setup"], r["label"], str(r["micro_batch"]), f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if same else "n/a",
                     _num(r["peak_gib"], ".1f"), f"{r['activation_gib']:.4g}", f"{r['offloaded_gib']:.4g}",
                     _num(r["forward_retained_gib"], ".2f"), _largest(searches.get(r["setup"]))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _get(results, name) -> Optional[dict]:
    return next((r for r in results if r["setup"] == name and not r.get("oom") and "tokens_per_s" in r), None)


def targets(results: list[dict]) -> list[str]:
    """The issue's targets, each as measured in this run (or why it could not be checked)."""
    off, kept = _get(results, "memtrain:full+offload"), _get(results, "memtrain:full")
    base, hf, ds = _get(results, BASELINE), _get(results, "torch:hf-ac"), _get(results, "deepspeed:cpu-ckpt")
    lines = []

    def ratio(a, b, what, goal):
        if a is None or b is None:
            lines.append(f"- {what}: not measured (a set-up is missing or ran out of memory)")
        else:
            value = a["tokens_per_s"] / b["tokens_per_s"]
            met = "" if goal is None else (" - met" if value >= goal else " - NOT met")
            lines.append(f"- {what}: {value:.2f}" + (f" (target >= {goal}){met}" if goal is not None else ""))

    ratio(off, kept, "tokens/s, memtrain:full+offload / memtrain:full", 0.95)
    ratio(ds, kept, "tokens/s, deepspeed:cpu-ckpt / memtrain:full (DeepSpeed's own offload, for reference)", None)
    ratio(off, base, "tokens/s, memtrain:full+offload / torch:noac", 0.80)
    if off is not None and hf is not None and off["peak_gib"] is not None:
        met = "met" if off["peak_gib"] <= hf["peak_gib"] else "NOT met"
        lines.append(f"- peak GiB, memtrain:full+offload {off['peak_gib']:.1f} vs torch:hf-ac {hf['peak_gib']:.1f} "
                     f"(target <=) - {met}")
    else:
        lines.append("- peak GiB, memtrain:full+offload vs torch:hf-ac: not measured")
    return lines

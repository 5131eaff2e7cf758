"""The benchmark's report: one markdown table, plus the recompute targets checked against it."""
from __future__ import annotations

from typing import Optional

from memtrain.tools.bench.setups import BASELINE

COLUMNS = ("set-up", "what", "micro-batch", "tokens/s per GPU", "x no-AC", "peak GiB", "predicted GiB",
           "activation GiB", "offloaded GiB", "largest micro-batch")


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
                     _num(r.get("peak_gib"), ".1f"), _num(r.get("predicted_peak_gib"), ".1f"),
                     _num(r.get("activation_gib"), ".4g"), _num(r.get("offloaded_gib"), ".4g"),
                     _largest(searches.get(r["setup"]))]
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


# --------------------------------------------------------------------------- make gpu-check

GPU_COLUMNS = ("set-up", "what", "plan", "micro-batch", "tokens/s per GPU", "x plain", "peak GiB",
               "predicted GiB", "error", "MFU", "HFU", "offloaded GiB")


def _ok(r: Optional[dict]) -> bool:
    return r is not None and not r.get("oom") and "tokens_per_s" in r


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def prediction_error(r: dict) -> Optional[float]:
    """(predicted - measured) / measured peak, or None."""
    if not r.get("peak_gib") or r.get("predicted_peak_gib") is None:
        return None
    return r["predicted_peak_gib"] / r["peak_gib"] - 1


def gpu_check_markdown(results: list[dict]) -> str:
    plain = next((r for r in results if r["setup"] == BASELINE and _ok(r)), None)
    rows = ["| " + " | ".join(GPU_COLUMNS) + " |", "|" + "---|" * len(GPU_COLUMNS)]
    for r in results:
        if not _ok(r):
            status = "OOM" if r.get("oom") else f"failed: {r.get('error', '')[:120]}"
            cells = [r["setup"], r["label"], "", str(r["micro_batch"]), status] + [""] * (len(GPU_COLUMNS) - 5)
        else:
            err = prediction_error(r)
            cells = [r["setup"], r["label"], f"`{r['plan']}`" if r.get("plan") else "", str(r["micro_batch"]),
                     f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}" if plain else "n/a",
                     _num(r.get("peak_gib"), ".2f"), _num(r.get("predicted_peak_gib"), ".2f"),
                     "n/a" if err is None else f"{100 * err:+.1f}%", _pct(r.get("mfu")), _pct(r.get("hfu")),
                     _num(r.get("offloaded_gib"), ".2f")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def gpu_check_targets(results: list[dict]) -> list[str]:
    """The recompute issue's GPU targets, each a ratio of two figures measured in the same run."""
    get = {r["setup"]: r for r in results if _ok(r)}
    off, plain = get.get("memtrain:full+offload"), get.get(BASELINE)
    hf, sac, op = get.get("torch:hf-ac"), get.get("torch:sac"), get.get("memtrain:op")
    lines = []

    def check(what, value, goal, higher=True):
        if value is None:
            lines.append(f"- {what}: not measured (a set-up failed or ran out of memory)")
            return
        met = value >= goal if higher else value <= goal
        lines.append(f"- {what}: {value:.2f} (target {'>=' if higher else '<='} {goal}) - {'met' if met else 'NOT met'}")

    ratio = lambda a, b: a["tokens_per_s"] / b["tokens_per_s"] if a and b else None  # noqa: E731
    check("tokens/s, full + offload / plain PyTorch no-AC", ratio(off, plain), 0.80)
    check("tokens/s, full + offload / transformers' gradient checkpointing (torch:hf-ac)", ratio(off, hf), 1.0)
    check("peak, full + offload / plain PyTorch no-AC",
          off["peak_gib"] / plain["peak_gib"] if off and plain and plain.get("peak_gib") else None, 0.42, higher=False)
    check("tokens/s, memtrain op / torch op-level SAC (torch:sac)", ratio(op, sac), 1.0)
    fitting = [r for r in get.values() if plain and r["setup"].startswith(("memtrain:", "deepspeed:"))
               and r.get("peak_gib") and plain.get("peak_gib") and r["peak_gib"] <= 0.5 * plain["peak_gib"]]
    best = max(fitting, key=lambda r: r["tokens_per_s"], default=None)
    check(f"tokens/s, best plan with peak <= 50% of plain no-AC's ({best['setup'] if best else 'none fits'}) / "
          "plain no-AC", ratio(best, plain) if best else None, 0.90)
    # compiled set-ups too: their layers are predicted compiled (memtrain.memory.profile)
    errors = {name: prediction_error(r) for name, r in get.items() if name.startswith("memtrain:")}
    worst = max((abs(e) for e in errors.values() if e is not None), default=None)
    check("largest |predicted - measured| / measured peak over the trainer set-ups", worst, 0.05, higher=False)
    check("best MFU", max((r["mfu"] for r in get.values() if r.get("mfu")), default=None), 0.50)
    # train.compile (memtrain.recompute.compiled)
    check("tokens/s, compiled full + offload / eager full + offload", ratio(get.get("memtrain:full+offload+compile"),
                                                                           off), 1.10)
    check("best MFU of a compiled set-up", max((r["mfu"] for n, r in get.items() if n.endswith("+compile")
                                                and r.get("mfu")), default=None), 0.45)
    return lines

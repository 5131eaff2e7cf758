"""`make bench-plan`: how fast `make plan --search` scores configurations on one CPU core -> reports/plan_search.md.

The search runs twice in one process, on one thread: the first run measures the activation profiles
(fake tensors) and scores; the second finds every profile cached and only scores. The second run's
configurations per second is the scoring rate (issue 37's target: 100,000 in at most 10 s).
"""
from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from memtrain.errors import ArgumentParser, cli_entry

TARGET_PER_S = 100_000 / 10


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _timed_search(recipe, ds, hw, nodes: int, tokens: int):
    from memtrain.memory.search import search  # noqa: PLC0415 pulls numpy, pydantic, torch: heavy, kept off --help

    t0 = time.perf_counter()
    result = search(recipe, ds, hw, nodes, tokens)
    return result, time.perf_counter() - t0


def report(recipe_path: str, hw_path: str, nodes: int, tokens: int) -> str:
    import torch  # noqa: PLC0415 torch: heavy, kept off --help

    from memtrain.config.ds_config import load_ds_config  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.config.recipe import load_recipe  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.memory.hardware import load_hardware  # noqa: PLC0415 pulls pydantic: heavy, kept off --help

    torch.set_num_threads(1)
    recipe, ds, hw = load_recipe(recipe_path), load_ds_config("ds_configs/zero3_ckpt.json"), load_hardware(hw_path)
    with contextlib.redirect_stdout(sys.stderr):
        first, t_first = _timed_search(recipe, ds, hw, nodes, tokens)
        second, t_second = _timed_search(recipe, ds, hw, nodes, tokens)
    rate = second.considered / t_second
    scored_rate = len(second.scored) / t_second
    return "\n".join([
        "# `make plan --search`: configurations scored per second", "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} ({_cpu()}), one torch thread, "
        f"on a machine other engineers share (timings vary with their load; load average {_load()}).", "",
        f"Search: recipe {recipe.name} on {nodes} x {hw.name}, {tokens:,} tokens per step, "
        "ds_configs/zero3_ckpt.json as the base JSON.", "",
        "| run | seconds | configurations | of them scored (per-layer solver + step time) | per second |",
        "|---|---:|---:|---:|---:|",
        f"| first (profiles measured on fake tensors, then scored) | {t_first:.1f} | {first.considered:,} | "
        f"{len(first.scored):,} | {first.considered / t_first:,.0f} |",
        f"| second (profiles cached: scoring only) | {t_second:.1f} | {second.considered:,} | {len(second.scored):,} | "
        f"{rate:,.0f} |", "",
        f"Scoring rate: {rate:,.0f} configurations per second ({scored_rate:,.0f} that reach the solver and the "
        f"step-time model); target {TARGET_PER_S:,.0f} per second (100,000 in 10 s): "
        + ("met." if rate >= TARGET_PER_S else "not met. What is left: the exact per-layer solver (numpy, one DP per "
           "limit where keeping every layer does not fit) and the memory model's walk per plan."), ""])


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f} over the last minute, {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain bench-plan", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/llama-1b.yaml")
    p.add_argument("--hardware", default="hardware/h100-sxm-8x.yaml")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--global-batch-tokens", type=int, default=1 << 20)
    p.add_argument("--out", default="reports/plan_search.md")
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    text = report(args.recipe, args.hardware, args.nodes, args.global_batch_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

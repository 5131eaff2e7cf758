"""`make bench-plan`: how fast `make plan --search` scores configurations on one CPU core -> reports/plan_search.md.

Two measurements, in one process on one thread. First the search of one cluster runs twice: the first run
measures the activation profiles (fake tensors) and scores; the second finds every profile cached and only
scores. Then a grid of searches (node counts x global batch sizes, each a search of its own: its own families,
solves and memos; the profiles and the meta model measured in an untimed pass before) is timed: for llama-1b
on H100 nodes it holds 102,060 configurations. Issue 37's target is 100,000 scored in at most 10 s.
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

TARGET_CONFIGS, TARGET_SECONDS = 100_000, 10.0
TARGET_PER_S = TARGET_CONFIGS / TARGET_SECONDS
GRID_NODES = (1, 2, 4, 8, 16)
GRID_TOKENS = tuple(1 << k for k in range(18, 27))  # 256 Ki ... 64 Mi tokens per step


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


def report(recipe_path: str, hw_path: str, nodes: int, tokens: int, grid_nodes=GRID_NODES,
           grid_tokens=GRID_TOKENS) -> str:
    import torch  # noqa: PLC0415 torch: heavy, kept off --help

    from memtrain.config.ds_config import load_ds_config  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.config.recipe import load_recipe  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.memory.hardware import load_hardware  # noqa: PLC0415 pulls pydantic: heavy, kept off --help

    torch.set_num_threads(1)
    recipe, ds, hw = load_recipe(recipe_path), load_ds_config("ds_configs/zero3_ckpt.json"), load_hardware(hw_path)
    load_before = _load()
    with contextlib.redirect_stdout(sys.stderr):
        first, t_first = _timed_search(recipe, ds, hw, nodes, tokens)
        second, t_second = _timed_search(recipe, ds, hw, nodes, tokens)
        grid = [(n, t) for n in grid_nodes for t in grid_tokens]
        for n, t in grid:  # untimed: every profile the grid needs measured
            _timed_search(recipe, ds, hw, n, t)
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = [_timed_search(recipe, ds, hw, n, t)[0] for n, t in grid]
        t_grid, cpu_grid = time.perf_counter() - t0, time.process_time() - cpu0
    considered = sum(r.considered for r in results)
    reached = sum(len(r.scored) + _solved_then_dropped(r) for r in results)
    return "\n".join([
        "# `make plan --search`: configurations scored per second", "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()} ({_cpu()}), one torch thread, "
        f"on a machine other engineers share (wall times vary with their load; 1-minute load average "
        f"{load_before} before, {_load()} after, on {os.cpu_count()} cores).", "",
        f"Recipe {recipe.name} on {hw.name} nodes, ds_configs/zero3_ckpt.json as the base JSON.", "",
        "## One search", "",
        f"{nodes} node(s), {tokens:,} tokens per step.", "",
        "| run | seconds | configurations | of them scored (per-layer solver + step time) | per second |",
        "|---|---:|---:|---:|---:|",
        f"| first (profiles measured on fake tensors, then scored) | {t_first:.2f} | {first.considered:,} | "
        f"{len(first.scored):,} | {first.considered / t_first:,.0f} |",
        f"| second (profiles cached: scoring only) | {t_second:.3f} | {second.considered:,} | "
        f"{len(second.scored):,} | {second.considered / t_second:,.0f} |", "",
        "## A grid of searches (the target)", "",
        f"{len(grid)} searches: nodes {', '.join(map(str, grid_nodes))} x global batch "
        f"{', '.join(_tokens(t) for t in grid_tokens)} tokens per step; each search with its own families, "
        "solves and memos, the profiles and the meta model measured in an untimed pass before.", "",
        "| seconds (wall) | seconds (this process's CPU) | configurations | reaching the per-layer solver and the "
        "step-time model | per wall second | per CPU second |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {t_grid:.2f} | {cpu_grid:.2f} | {considered:,} | {reached:,} | {considered / t_grid:,.0f} | "
        f"{considered / cpu_grid:,.0f} |", "",
        f"Target: {TARGET_CONFIGS:,} configurations in at most {TARGET_SECONDS:.0f} s: "
        + _verdict(considered, t_grid, reached) + " CPU seconds stand for an idle core: the process's own time on a "
        "shared machine, less sensitive to the load than wall time, though caches shared with other jobs still slow "
        "it.", ""])


def _solved_then_dropped(result) -> int:
    """Configurations dropped after their plan was chosen (no layer offloaded, host RAM with the offloads)."""
    return sum(n for reason, n in result.dropped.items()
               if reason.startswith(("activation offload on, but", "host RAM per node exceeded by the ranks' offloads")))


def _verdict(considered: int, seconds: float, reached: int) -> str:
    rate = considered / seconds
    if considered >= TARGET_CONFIGS and seconds <= TARGET_SECONDS:
        return (f"met ({considered:,} in {seconds:.1f} s, {rate:,.0f} per second; {reached / seconds:,.0f} per "
                "second of those that reach the solver and the step-time model).")
    return (f"not met: {rate:,.0f} per second against {TARGET_PER_S:,.0f} ({reached / seconds:,.0f} per second of "
            "those that reach the solver and the step-time model).")


def _tokens(n: int) -> str:
    return f"{n >> 20} Mi" if n >= 1 << 20 else f"{n >> 10} Ki"


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain bench-plan", description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/llama-1b.yaml")
    p.add_argument("--hardware", default="hardware/h100-sxm-8x.yaml")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--global-batch-tokens", type=int, default=1 << 20)
    p.add_argument("--grid-nodes", type=int, nargs="+", default=list(GRID_NODES))
    p.add_argument("--grid-tokens", type=int, nargs="+", default=list(GRID_TOKENS))
    p.add_argument("--out", default="reports/plan_search.md")
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    text = report(args.recipe, args.hardware, args.nodes, args.global_batch_tokens, args.grid_nodes, args.grid_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

"""`make plan ARGS="--search --hardware hardware/h100-sxm-8x.yaml --nodes N --global-batch-tokens T"`: the search's output.

A ranked table of the best configurations, the figures used (sheet or calibration), why the rest was
dropped, a Pareto plot of peak memory against tokens/s, and the winner's DeepSpeed JSON and recipe under
`plans/<name>/`, which `deepspeed src/train.py --deepspeed plans/<name>/ds.json --recipe
plans/<name>/recipe.yaml` runs as they are. The search itself is memtrain.memory.search.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import yaml
from tqdm import tqdm

from memtrain.errors import UserError
from memtrain.memory.hardware import Hardware, load_hardware
from memtrain.memory.score import Scored
from memtrain.memory.search import SearchResult, family_of, search
from memtrain.units import GIB, parse_size
from memtrain.memory.target import model_and_config
from memtrain.tools.max_seq import sequence_sizes

COLUMNS = ("#", "ZeRO", "offload", "TP", "SP", "mb", "GA", "recompute (layers)", "peak GiB", "host GiB/node",
           "step s", "tokens/s", "MFU", "binds")


def plan_marks(scored: Scored) -> str:
    """The per-layer plan as counts: '14 keep, 8 full+offload'."""
    counts: dict[str, int] = {}
    for c in scored.layers:
        counts[str(c)] = counts.get(str(c), 0) + 1
    return ", ".join(f"{n} {c}" for c, n in counts.items())


def row(i: int, s: Scored) -> list[str]:
    c = s.config
    off = "+".join(n for n, on in (("opt", c.offload_optimizer), ("param", c.offload_param),
                                   ("act", c.activation_offload)) if on) or "-"
    return [str(i), str(c.zero_stage), off, str(c.tp), str(c.sp), str(c.micro_batch), str(c.grad_accum),
            plan_marks(s), f"{s.peak / GIB:.2f}", f"{s.host_per_node / GIB:.1f}", f"{s.time.seconds:.3f}",
            f"{s.tokens_per_s:,.0f}", f"{s.mfu:.1%}", s.time.binding]


def table(rows: list[list[str]], head) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(str(v).rjust(w) if i not in (2, 7, 13) else str(v).ljust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(cells, widths)))
    return [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_search(result: SearchResult, recipe, hw: Hardware, nodes: int, top: int) -> str:
    lines = [f"memtrain plan --search: recipe {recipe.name} on {nodes} node(s) x {hw.gpus_per_node} GPUs of "
             f"{hw.name} (world {result.world}), {result.global_tokens:,} tokens per step; GPU budget "
             f"{result.budget / GIB:.4g} GiB, host budget {result.host_budget / GIB:.0f} GiB per node",
             "figures used: " + "; ".join(f"{k} {_figure(k, v)} ({o})" for k, v, o in hw.figures()),
             f"{result.considered:,} configurations: {len(result.scored):,} scored, "
             f"{sum(result.dropped.values()):,} dropped", ""]
    lines += table([row(i + 1, s) for i, s in enumerate(result.scored[:top])], COLUMNS)
    lines.append("(peak: predicted max_memory_allocated per GPU, memtrain.memory.predict; step s: predicted, "
                 "not measured on GPU; binds: the largest term of the step time; GA: gradient accumulation)")
    if result.dropped:
        lines += ["", "dropped (configurations, reason):"]
        lines += [f"  {n:>6,}  {reason}" for reason, n in result.dropped.most_common()]
    return "\n".join(lines)


def _figure(key: str, v) -> str:
    return f"{v / GIB:.4g} GiB" if key in ("gpu.memory", "node.host_ram") else f"{v:g}"


def pareto(scored: list[Scored]) -> list[Scored]:
    """The configurations no other beats in both peak memory (lower) and tokens/s (higher)."""
    front, best = [], -1.0
    for s in sorted(scored, key=lambda x: (x.peak, -x.tokens_per_s)):
        if s.tokens_per_s > best:
            front.append(s)
            best = s.tokens_per_s
    return front


def plot(scored: list[Scored], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 matplotlib: heavy, imported only when this runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 matplotlib: heavy, imported only when this runs

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([s.peak / GIB for s in scored], [s.tokens_per_s for s in scored], s=8, alpha=0.4,
               label="scored configurations")
    front = pareto(scored)
    ax.plot([s.peak / GIB for s in front], [s.tokens_per_s for s in front], "o-", color="C3", label="Pareto front")
    ax.scatter([scored[0].peak / GIB], [scored[0].tokens_per_s], marker="*", s=200, color="C2", zorder=3,
               label=f"winner: {scored[0].config.label()}")
    ax.set_xlabel("predicted peak GPU memory (GiB)")
    ax.set_ylabel("predicted tokens/s (not measured)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plan(result: SearchResult, recipe, best: Scored, out: Path) -> tuple[Path, Path]:
    """plans/<name>/ds.json and recipe.yaml of the winner."""
    ds, r = family_of(result, recipe, best)
    out.mkdir(parents=True, exist_ok=True)
    ds_path, recipe_path = out / "ds.json", out / "recipe.yaml"
    ds_path.write_text(json.dumps(ds, indent=2) + "\n", encoding="utf-8")
    data = r.model_dump(mode="json", exclude_defaults=True)
    data["name"] = out.name
    head = (f"# written by `memtrain plan --search`: {best.config.label()}, predicted peak {best.peak / GIB:.2f} GiB "
            f"per GPU,\n# {best.tokens_per_s:,.0f} tokens/s (not measured) on {result.world} GPUs. Per-layer "
            f"recompute: policy auto under memory_budget\n# (the solver the search ran); its plan: "
            f"{plan_marks(best)}\n")
    recipe_path.write_text(head + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return ds_path, recipe_path


def run_search(args, recipe, ds_config: dict) -> tuple[SearchResult, Hardware, Path]:
    """The --search branch of `python -m memtrain plan`: the result, the hardware it used, where the winner went."""
    if not args.hardware or args.nodes is None or args.global_batch_tokens is None:
        raise UserError("--search: needs --hardware FILE, --nodes N and --global-batch-tokens T")
    if args.nodes < 1 or args.global_batch_tokens < 1:
        raise UserError("--nodes and --global-batch-tokens: must be positive")
    hw = load_hardware(args.hardware, args.calibration)
    if args.gpus_per_node is not None:
        if not 1 <= args.gpus_per_node <= hw.gpus_per_node:
            raise UserError(f"--gpus-per-node: must be 1 to {hw.gpus_per_node} ({args.hardware}'s gpus_per_node)")
        hw = replace(hw, gpus_per_node=args.gpus_per_node)  # the same GPUs and links, fewer of them a node
    world = args.nodes * hw.gpus_per_node
    sp_ok = sequence_sizes(model_and_config(recipe), world)
    budget = parse_size(args.budget, "--budget") if args.budget else None
    host = parse_size(args.host_budget, "--host-budget") if args.host_budget else None
    progress = _bar if sys.stderr.isatty() else None
    result = search(recipe, ds_config, hw, args.nodes, args.global_batch_tokens, budget, host, sp_ok,
                    progress=progress)
    if args.json:
        print(json.dumps(to_json(result, hw), indent=2))
    else:
        print(format_search(result, recipe, hw, args.nodes, args.top))
    if not result.scored:
        raise UserError("--search: no configuration fits; the dropped reasons above say why")
    gpus = f"x{hw.gpus_per_node}" if args.gpus_per_node is not None else ""
    out = Path(args.out or f"plans/{recipe.name}-{hw.name}-{args.nodes}n{gpus}")
    ds_path, recipe_path = write_plan(result, recipe, result.scored[0], out)
    plot(result.scored, out / "pareto.png", f"{recipe.name} on {args.nodes} x {hw.name}, "
                                             f"{args.global_batch_tokens:,} tokens/step")
    print(f"\nwinner: {ds_path}, {recipe_path}; Pareto plot {out / 'pareto.png'}\n"
          f"run it: deepspeed src/train.py --deepspeed {ds_path} --recipe {recipe_path}", file=sys.stderr)
    return result, hw, out


def _bar(items):
    return tqdm(items, desc="search (TP x SP x offload families)", file=sys.stderr)


def to_json(result: SearchResult, hw: Hardware, top: Optional[int] = 50) -> dict:
    return {"world": result.world, "budget": result.budget, "host_budget": result.host_budget,
            "global_tokens": result.global_tokens, "figures": [list(f) for f in hw.figures()],
            "dropped": dict(result.dropped),
            "top": [{"config": vars(s.config), "layers": [str(c) for c in s.layers], "peak": s.peak,
                     "host_per_node": s.host_per_node, "terms": s.time.terms, "step_s": s.time.seconds,
                     "tokens_per_s": s.tokens_per_s, "mfu": s.mfu, "binding": s.time.binding}
                    for s in result.scored[:top]]}

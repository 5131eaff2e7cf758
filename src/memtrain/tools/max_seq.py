"""`make plan BUDGET=... ARGS=--max-seq`: the longest sequence that fits, per combination of
recompute policy x offload of checkpointed inputs x loss (standard/fused) x tiled MLP x sequence
parallelism, and which memory runs out first: the device's or the host's.

Per combination, one rank's activation profile is measured on fake tensors (memtrain.memory.profile,
with the run's loss and tiled MLPs installed; memory only, no FLOPs counted) at two long per-rank token counts (32 and 64 times
the hidden size) and extended field by field along the line through them. Memory on a GPU is
linear in the tokens (flash/efficient attention keeps no T x T scores; a tiled MLP with `auto`
slices is a constant); the fused loss's is not quite: its bytes per token change by a few percent between
4x and 128x the hidden size, so the line is exact near the probes and an answer below them can be up to 1.6% over
the budget (measured: reports/readme/long-sequences.md; a quadratic through three points was tried and
extrapolated the chunking's steps far too steeply). Sequence parallelism divides the
sequence over its ranks, so a sequence S puts T = S / sp tokens on each rank. The host side is
what offloaded checkpointed inputs take (L x T x hidden x bytes per rank, from the profile) plus
offloaded model states, for every rank of a node.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Optional

from memtrain.config.ds_config import zero_stage
from memtrain.memory.predict import LayerChoice, predict
from memtrain.memory.profile import ActivationProfile, profile_activations
from memtrain.memory.states import model_states
from memtrain.memory.target import make_target, model_and_config
from memtrain.recompute.policy import FULL, KEEP
from memtrain.model.loss import fused_unsupported
from memtrain.units import GIB
from memtrain.errors import UserError
from memtrain.train.sequence_parallel import check

POLICIES = (("none", LayerChoice(KEEP)), ("full", LayerChoice(FULL)), ("full+offload", LayerChoice(FULL, offload=True)))
RANKS_PER_NODE = 8  # GPUs of one node that share its host memory (capped by the world size)


def host_memory_bytes() -> int:
    """This machine's physical memory (the default host budget)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fit(profiles: list[ActivationProfile], tokens: int) -> ActivationProfile:
    """Every int/float field of the profile on the line through two measured token counts."""
    (t1, t2) = [p.target.seq_len for p in profiles]

    def fit(values):
        v = max(values[0] + (values[1] - values[0]) * (tokens - t1) / (t2 - t1), 0)
        return int(round(v)) if isinstance(values[0], int) else v

    def fields(objs):
        return {k: fit([getattr(o, k) for o in objs]) for k, v in asdict(objs[0]).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}

    first = profiles[0]
    layers = {m: replace(c, **fields([p.layers[m] for p in profiles])) for m, c in first.layers.items()}
    scalars = {k: fit([getattr(p, k) for p in profiles]) for k in
               ("outside_saved", "base", "head_excess", "head_net", "tail_excess", "largest_block")}
    return replace(first, target=replace(first.target, seq_len=tokens), layers=layers, **scalars)


def _choices(choice: LayerChoice, num_layers: int, skip_last: int) -> tuple[LayerChoice, ...]:
    if choice.offload:  # the last layers keep their input on the device (offload_skip_last)
        keep = min(skip_last, num_layers)
        return (choice,) * (num_layers - keep) + (LayerChoice(FULL),) * keep
    return (choice,) * num_layers


def largest(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ok(n) (ok monotone: true up to some n, false after), or 0: a binary search."""
    if not ok(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def sequence_sizes(config, world: int, stage: int = 3) -> list[int]:
    """Sequence-parallel sizes a run would take: those memtrain.train.sequence_parallel.check lets through for
    the world, the heads and the model's attention (a sliding window is checked against the sequence there, at
    the run's own length; here each size is asked at its shortest)."""
    def allowed(s: int) -> bool:
        try:
            check(s, config, s, world, stage, getattr(config, "_attn_implementation", None))
        except UserError:
            return False
        return True

    return [s for s in range(1, world + 1) if allowed(s)]


def max_seq_report(recipe, ds_config: dict, world: int, device: Optional[str], budget: int,
                   host_budget: int, limit: int = 1 << 24) -> dict:
    config = model_and_config(recipe)
    base = make_target(recipe, ds_config, world, device)
    base = replace(base, sequence_parallel=1)
    hidden = config.hidden_size
    probe = [hidden * k for k in (32, 64)]  # per-rank tokens measured (multiples of hidden: whole slices)
    losses = ["standard"] + ([] if fused_unsupported(config) else ["fused"])
    skip_last = recipe.activation_checkpointing.offload_skip_last
    positions = getattr(config, "max_position_embeddings", None)  # the trainer refuses a longer data.seq_len
    limit = min(limit, positions) if positions else limit
    ranks_per_node = min(world, RANKS_PER_NODE)
    rows = []
    for loss in losses:
        for tiled in (0, "auto"):
            targets = [replace(base, seq_len=t, loss=loss, tiled_mlp=tiled) for t in probe]
            profiles = [profile_activations(config, t, (KEEP, FULL), count_flops=False) for t in targets]  # memory only
            states = model_states(profiles[0], ds_config, targets[0])
            for sp in sequence_sizes(config, world, zero_stage(ds_config)):
                for name, choice in POLICIES:
                    choices = _choices(choice, profiles[0].num_layers, skip_last)

                    def pred(tokens):
                        return predict(_fit(profiles, tokens), states, choices)

                    def host(tokens):
                        return (pred(tokens).host_activations + states.host) * ranks_per_node

                    dev_t = largest(lambda t: pred(t).peak <= budget, 1, limit // sp)
                    host_t = largest(lambda t: host(t) <= host_budget, 1, limit // sp) if choice.offload \
                        or states.host else limit // sp
                    tokens = min(dev_t, host_t)
                    row = {"policy": name, "loss": loss, "tiled_mlp": tiled, "sequence_parallel": sp,
                           "max_seq": tokens * sp, "tokens_per_rank": tokens,
                           "runs_out_first": "device" if dev_t <= host_t else "host",
                           "device_peak_gib": pred(tokens).peak / GIB if tokens else None,
                           "peak_at": pred(tokens).peak_at if tokens else None,
                           "host_gib": host(tokens) / GIB if tokens else None}
                    if tokens == limit // sp:
                        row["runs_out_first"] = (f"neither: the model's {positions} positions bind" if limit == positions
                                                 else f"neither below {limit} tokens")
                    rows.append(row)
    return {"recipe": recipe.name, "world_size": world, "device": base.device, "dtype": base.dtype,
            "budget_gib": budget / GIB, "host_budget_gib": host_budget / GIB, "ranks_per_node": ranks_per_node,
            "probe_tokens_per_rank": probe, "position_limit": positions, "position_note": position_note(config),
            "rows": rows}


def position_note(config) -> Optional[str]:
    """What bounds every sequence of this model, and what would lift it."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None)
    lift = ("a longer context needs RoPE scaling: model.config.rope_parameters (e.g. rope_type yarn or linear with a "
            "factor) and a larger model.config.max_position_embeddings" if rope else
            "its positions are learned embeddings, so a longer context needs a model trained with more")
    return f"no sequence above the model's max_position_embeddings ({positions:,}), which the trainer refuses; {lift}"


def format_max_seq(r: dict) -> str:
    lines = [f"memtrain plan --max-seq: recipe {r['recipe']}, {r['world_size']} device(s), {r['dtype']} on "
             f"{r['device']}; device budget {r['budget_gib']:g} GiB, host budget {r['host_budget_gib']:.0f} GiB "
             f"per node ({r['ranks_per_node']} rank(s) per node)",
             f"one rank's activations measured on fake tensors at {', '.join(map(str, r['probe_tokens_per_rank']))} "
             "tokens per rank, extended linearly", ""]
    head = ["policy", "loss", "tiled MLP", "SP", "max seq", "tokens/rank", "device GiB", "host GiB/node", "runs out first",
            "device peak at"]
    rows = [[x["policy"], x["loss"], str(x["tiled_mlp"] or "-"), str(x["sequence_parallel"]), f"{x['max_seq']:,}",
             f"{x['tokens_per_rank']:,}", "-" if x["device_peak_gib"] is None else f"{x['device_peak_gib']:.2f}",
             "-" if x["host_gib"] is None else f"{x['host_gib']:.1f}", x["runs_out_first"], x["peak_at"] or "-"]
            for x in r["rows"]]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i < 4 or i >= 8 else str(c).rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows]
    lines.append("(max seq: the longest sequence whose predicted peak fits the device budget and whose offloaded "
                 "inputs and offloaded model states fit the host budget; a predicted figure, not a measured one)")
    if r.get("position_note"):
        lines.append(f"({r['position_note']})")
    return "\n".join(lines)

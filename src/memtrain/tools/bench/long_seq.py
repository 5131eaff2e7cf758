"""`make gpu-check`'s long-sequence part: the long-context recipes at their target lengths on one
GPU (fused loss, tiled MLPs, full recompute with checkpointed inputs offloaded to host memory), and
the fused loss against the standard one at an ordinary length. Every figure is a measured run of
the trainer (memtrain.tools.bench.Runner): peak allocated memory and tokens/s from its summary.json.
"""
from __future__ import annotations

from typing import Callable

LONG_DS = "ds_configs/zero3_offload_ckpt.json"
# (recipe, sequence length): the single-GPU targets
LONG_RUNS = (("recipes/llama-8b-long.yaml", 262_144), ("recipes/qwen2-1.5b-long.yaml", 1_048_576))
ORDINARY_SEQ = 8192  # fused vs standard, the 1.5B shape, full recompute, inputs kept on the GPU
LONG_STEPS, LONG_WARMUP = 3, 2


def run_long_part(make_runner: Callable, write: Callable[[str], None]) -> list[dict]:
    """make_runner(recipe, ds_path, steps, warmup) -> a bench Runner on one GPU. Returns the results."""
    results = []
    for recipe, seq in LONG_RUNS:
        run = make_runner(recipe, LONG_DS, LONG_STEPS, LONG_WARMUP)
        result = run("memtrain:full+offload", extra=(f"data.seq_len={seq}",))
        result["label"] = f"{recipe} at {seq:,} tokens, fused + tiled MLP + full + offload"
        results.append(result)
        write(str(result))
    run = make_runner("recipes/qwen2-1.5b-long.yaml", LONG_DS, 10, 5)
    for loss in ("standard", "fused"):
        result = run("memtrain:full", extra=(f"data.seq_len={ORDINARY_SEQ}", f"train.loss={loss}",
                                              "activation_checkpointing.tiled_mlp=0"))
        result["label"] = f"qwen2-1.5b-long at {ORDINARY_SEQ:,} tokens, loss {loss}"
        results.append(result)
        write(str(result))
    return results


def long_part_markdown(results: list[dict]) -> str:
    lines = ["| run | tokens/s | peak GiB | predicted GiB | status |", "|---|---|---|---|---|"]
    for r in results:
        ok = "tokens_per_s" in r
        status = "completed" if ok else ("OOM" if r.get("oom") else f"failed: {str(r.get('error', ''))[:120]}")
        lines.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r.get('peak_gib') or 0:.2f} | "
                     f"{r.get('predicted_peak_gib') or 0:.2f} | {status} |" if ok else
                     f"| {r['label']} |  |  |  | {status} |")
    std, fused = results[-2], results[-1]
    if "tokens_per_s" in std and "tokens_per_s" in fused:
        lines += ["", f"fused / standard at {ORDINARY_SEQ:,} tokens: tokens/s {fused['tokens_per_s'] / std['tokens_per_s']:.3f} "
                      "(target >= 0.98), peak "
                      f"{(fused.get('peak_gib') or 0):.2f} vs {(std.get('peak_gib') or 0):.2f} GiB (target: lower)"]
    return "\n".join(lines)

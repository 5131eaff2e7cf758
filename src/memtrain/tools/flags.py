"""The command lines of plan, ac-profile, bench and gpu-check, whose modules import torch at the top: built here,
without it, so that `python -m memtrain <command> --help` answers at once (memtrain/__main__.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from memtrain.errors import ArgumentParser
from memtrain.tools.bench.setups import DEFAULT_SETUPS, HELP

DEFAULT_DS = "ds_configs/zero3_ckpt.json"
AC_PROFILE_CSV = "reports/ac_profile.csv"
AC_PROFILE_SEQ_LEN = 128  # ac-profile's default shape: min(recipe seq_len, this) x batch 1
BENCH_RECIPE = "recipes/llama-1b.yaml"
GPU_CHECK_TIMEOUT_S = 300  # a set-up takes ~50 s on one H100; a hung one must not take the rest's time


def plan_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain plan",
                       description="Predict a recipe's peak memory per device, per AC policy, before a run.")
    p.add_argument("--recipe", metavar="YAML", help="recipe file (default: the embedded tiny recipe)")
    p.add_argument("--deepspeed", default=DEFAULT_DS, metavar="JSON", help=f"DeepSpeed config (default: {DEFAULT_DS})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe key")
    p.add_argument("--budget", help="memory per device, e.g. 40GiB: adds max micro-batch/sequence and the auto plan")
    p.add_argument("--ngpus", type=int, default=1, help="world size (devices in the job; default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="device the run will use (default: this machine's); cuda also turns bf16 'auto' on")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-seq", action="store_true",
                   help="with --budget: the longest sequence that fits per policy x offload x loss x tiled MLP x "
                        "sequence parallelism, and whether device or host memory runs out first")
    p.add_argument("--host-budget", help="host memory per node for --max-seq (default: this machine's; with "
                                          "--search: 80%% of the sheet's host RAM)")
    _search_flags(p)
    return p


def _search_flags(p) -> None:
    """`python -m memtrain plan`'s flags for --search and --calibrate-from."""
    p.add_argument("--search", action="store_true",
                   help="search ZeRO stage x offloads x TP x SP x micro-batch x per-layer recompute for a cluster "
                        "(needs --hardware, --nodes, --global-batch-tokens; --budget defaults to 95%% of the GPU's)")
    p.add_argument("--hardware", metavar="YAML", help="--search: a node's hardware sheet (hardware/*.yaml)")
    p.add_argument("--calibration", metavar="YAML",
                   help="--search: measured figures over the sheet's (default: hardware/calibration/<sheet>.yaml)")
    p.add_argument("--nodes", type=int, help="--search: nodes")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="--search: GPUs used on each node, up to the sheet's (default: the sheet's gpus_per_node)")
    p.add_argument("--global-batch-tokens", type=int, metavar="T", help="--search: tokens per optimizer step")
    p.add_argument("--calibrate-from", metavar="JSON",
                   help="write the --hardware sheet's calibration file from a gpu-check report (reports/gpu/*.json)")
    p.add_argument("--top", type=int, default=15, help="--search: rows of the ranked table (default 15)")
    p.add_argument("--out", metavar="DIR", help="--search: where the winner goes (default plans/<recipe>-<sheet>-<N>n)")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="--search: run the top K configurations and a few random feasible ones for --verify-steps "
                        "steps through the sweep runner; print predicted against measured and Kendall's tau")
    p.add_argument("--verify-steps", type=int, default=10, metavar="N", help="--verify: steps per run (default 10)")
    p.add_argument("--verify-extra", type=int, default=3, metavar="N",
                   help="--verify: random feasible configurations run beside the top K (default 3)")
    p.add_argument("--verify-repeats", type=int, default=3, metavar="R",
                   help="--verify: runs per configuration, interleaved across configurations; the median is "
                        "measured and the spread shown (default 3)")
    p.add_argument("--launcher", choices=("deepspeed", "slurm"), help="--verify: the sweep runner's launcher "
                   "(default deepspeed: this machine)")


def ac_profile_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain ac-profile",
                       description="Measure each AC policy's activation memory and recompute cost on CPU.")
    p.add_argument("--recipe", metavar="YAML", help="recipe file (default: the embedded tiny recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe key (e.g. activation_checkpointing.op_save=[matmul/2,attention])")
    p.add_argument("--policies", help="comma-separated policies (default: a representative set)")
    p.add_argument("--seq-len", type=int, help=f"sequence length (default: min(recipe, {AC_PROFILE_SEQ_LEN}))")
    p.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    p.add_argument("--out", default=AC_PROFILE_CSV, help=f"CSV path (default: {AC_PROFILE_CSV})")
    return p


def bench_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain bench",
                       description="Recompute/offload set-ups side by side, each in its own process.")
    p.add_argument("--recipe", default=BENCH_RECIPE, help=f"shape to measure (default: {BENCH_RECIPE})")
    p.add_argument("--setups", default=None, help=f"comma-separated: {HELP} (default: make bench's "
                   f"{','.join(DEFAULT_SETUPS)}; with --gpu-check: all of its set-ups, in its order)")
    p.add_argument("--steps", type=int, default=10, help="measured steps after warm-up (default 10)")
    p.add_argument("--no-search", action="store_true", help="skip the largest-micro-batch probes")
    p.add_argument("--gpu-check", action="store_true", help="the fixed GPU acceptance run (python -m memtrain gpu-check)")
    _gpu_check_flags(p, "with --gpu-check: ")
    return p


def gpu_check_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain gpu-check",
                       description=f"The fixed GPU acceptance run on {BENCH_RECIPE} (30 steps per set-up), then "
                                   "long sequences: reports/gpu/<device>.md and <device>-long.md. Without a GPU: "
                                   "one line, exit 0.")
    p.add_argument("--setups", default=None, help=f"comma-separated: {HELP} (default: all of the check's, in its order)")
    _gpu_check_flags(p, "")
    p.set_defaults(gpu_check=True, recipe=BENCH_RECIPE, steps=10, no_search=False)
    return p


def _gpu_check_flags(p: argparse.ArgumentParser, only: str) -> None:
    """The flags that bench and gpu-check share; `only`: the words that say which of them only gpu-check reads."""
    p.add_argument("--deepspeed", default=DEFAULT_DS, metavar="JSON", help="DeepSpeed JSON for the trainer set-ups")
    p.add_argument("--no-long", action="store_true", help=f"{only}skip the long-sequence part")
    p.add_argument("--resume", action="store_true", help=f"{only}keep the set-ups this device's report "
                   "already measured and run only the others (a run split across calls on the same machine); the "
                   "long-sequence part runs whole each time, so pass --no-long until the last call")
    p.add_argument("--setup-timeout", type=float, default=None, metavar="S", help="kill a set-up's process after "
                   f"S seconds and go on (default: none for bench; {GPU_CHECK_TIMEOUT_S:g} for gpu-check)")
    p.add_argument("--out", type=Path, default=None, help="where the table and JSON go "
                   "(default reports/bench, or reports/gpu for gpu-check)")

"""`python -m memtrain <command>`: the one front door to every tool; `<command> --help` is each one's reference."""
from __future__ import annotations

import sys

# command -> (module whose main(argv) runs it, arguments put first, what it does)
COMMANDS = {
    "train": ("memtrain.train.main", (), "train in this process (under a launcher: src/train.py, same flags)"),
    "prepare-data": ("memtrain.tools.prepare_data", (), "tokenize a recipe's corpus into its token store before a job"),
    "preflight": ("memtrain.train.preflight", (), "every check of a run, before any worker starts (make train runs it)"),
    "plan": ("memtrain.tools.plan", (), "predicted peak memory per device for each AC policy; a budget's best plan"),
    "explain-config": ("memtrain.tools.explain_config", (), "one line per key of a DeepSpeed JSON: what the run does"),
    "ac-profile": ("memtrain.tools.ac_profile", (), "one measured CPU step per AC policy: bytes kept, FLOPs, time"),
    "sweep": ("memtrain.tools.sweep", (), "run every point of a sweep file's grid (resumable; Slurm or local)"),
    "report": ("memtrain.tools.report", (), "a sweep's TensorBoard scalars as tables and plots"),
    "bench": ("memtrain.tools.bench.__main__", (), "recompute/offload set-ups side by side on a GPU"),
    "gpu-check": ("memtrain.tools.bench.__main__", ("--gpu-check",), "the fixed GPU acceptance run -> reports/gpu/"),
    "bench-host": ("memtrain.tools.bench.host", (), "host work per step beside plain PyTorch, one CPU core"),
    "bench-data": ("memtrain.tools.bench.data_prep", (), "token store builds: MB/s and peak RSS -> reports/data_prep.md"),
    "export": ("memtrain.tools.export", (), "write a run's model checkpoint as a transformers model"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: python -m memtrain <command> [--help | arguments]", "", "commands:"]
                     + [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        known = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not known:
            print(f"memtrain: error: unknown command '{argv[0]}'", file=sys.stderr)
        print(usage(), file=sys.stdout if known else sys.stderr)
        sys.exit(0 if known else 2)
    module, first, _ = COMMANDS[argv[0]]
    if argv[0] == "train":  # a stop signal during start-up is recorded, not fatal (as in src/train.py)
        from memtrain.train import signals

        signals.install()
    import importlib

    importlib.import_module(module).main([*first, *argv[1:]])


if __name__ == "__main__":
    main()

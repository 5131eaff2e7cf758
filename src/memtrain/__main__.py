"""`python -m memtrain <command>`: the one front door to every tool; `<command> --help` is each one's reference.

`<command> --help` builds only the command's parser, from a module that imports no torch, so it answers at once;
the command itself parses its arguments with the same parser."""
from __future__ import annotations

import importlib
import sys

from memtrain.errors import cli_entry

PROG = "python -m memtrain"

# command -> ("module:function" that runs it with argv, "module:function" that builds its parser, what it does)
COMMANDS = {
    "train": ("memtrain.train.main:main", "memtrain.config.args:parser",
              "train in this process (under a launcher: src/train.py, same flags)"),
    "prepare-data": ("memtrain.tools.prepare_data:main", "memtrain.tools.prepare_data:parser",
                     "tokenize a recipe's corpus into its token store before a job"),
    "preflight": ("memtrain.train.preflight:main", "memtrain.config.args:preflight_parser",
                  "every check of a run, before any worker starts (make train runs it)"),
    "plan": ("memtrain.tools.plan:main", "memtrain.tools.flags:plan_parser",
             "predicted peak memory per device for each AC policy; a budget's best plan"),
    "explain-config": ("memtrain.tools.explain_config:main", "memtrain.tools.explain_config:explain_parser",
                       "one line per key of a DeepSpeed JSON: what the run does"),
    "ac-profile": ("memtrain.tools.ac_profile:main", "memtrain.tools.flags:ac_profile_parser",
                   "one measured CPU step per AC policy: bytes kept, FLOPs, time"),
    "sweep": ("memtrain.tools.sweep:main", "memtrain.tools.sweep:parser",
              "run every point of a sweep file's grid (resumable; Slurm or local)"),
    "report": ("memtrain.tools.report:main", "memtrain.tools.report:parser",
               "a sweep's TensorBoard scalars as tables and plots"),
    "bench": ("memtrain.tools.bench.__main__:main", "memtrain.tools.flags:bench_parser",
              "recompute/offload set-ups side by side on a GPU"),
    "gpu-check": ("memtrain.tools.bench.__main__:gpu_check_main", "memtrain.tools.flags:gpu_check_parser",
                  "the fixed GPU acceptance run -> reports/gpu/"),
    "bench-host": ("memtrain.tools.bench.host:main", "memtrain.tools.bench.host:parser",
                   "host work per step beside plain PyTorch, one CPU core"),
    "bench-plan": ("memtrain.tools.plan_bench:main", "memtrain.tools.plan_bench:parser",
                   "configurations make plan --search scores per second, one core"),
    "bench-data": ("memtrain.tools.bench.data_prep:main", "memtrain.tools.bench.data_prep:parser",
                   "token store builds: MB/s and peak RSS -> reports/data_prep.md"),
    "export": ("memtrain.tools.export:main", "memtrain.tools.export:parser",
               "write a run's model checkpoint as a transformers model"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join([f"usage: {PROG} <command> [--help | arguments]", "", "commands:"]
                     + [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()])


def load(target: str):
    """The function `module:function` names, its module imported now (and only then)."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def show_help(command: str, argv: list[str]) -> None:
    """`<command> ... --help`: the command's parser alone prints its help and exits; a `--help` that is another
    flag's value parses on, and the command runs as it would have."""
    flags = load(COMMANDS[command][1])()
    flags.prog = f"{PROG} {command}"
    cli_entry(flags.parse_known_args)(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        known = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not known:
            print(f"memtrain: error: unknown command '{argv[0]}'", file=sys.stderr)
        print(usage(), file=sys.stdout if known else sys.stderr)
        sys.exit(0 if known else 2)
    command, rest = argv[0], argv[1:]
    if {"-h", "--help"} & set(rest):
        show_help(command, rest)
    if command == "train":  # a stop signal during start-up is recorded, not fatal (as in src/train.py)
        from memtrain.train import signals  # noqa: PLC0415 start-up shim: only `train` needs it (and psutil)

        signals.install()
    try:
        load(COMMANDS[command][0])(rest)
    except KeyboardInterrupt:  # Ctrl-C: a stop asked for, not a failure to explain with a traceback
        print(f"memtrain {command}: stopped (Ctrl-C)", file=sys.stderr)
        sys.exit(128 + 2)


if __name__ == "__main__":
    main()
    from memtrain.quick_exit import quick_exit

    quick_exit()  # the command is over and written: no seconds of module teardown (memtrain.quick_exit)

"""`python -m memtrain <command>`: explain-config (what a run does with each key of a DeepSpeed JSON)
and export (a model checkpoint to a transformers directory)."""
from __future__ import annotations

import sys

COMMANDS = {
    "explain-config": ("memtrain.tools.explain_config", "one line per key of a DeepSpeed JSON: what the run does"),
    "export": ("memtrain.tools.export", "write a run's model checkpoint as a transformers model (save_pretrained)"),
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m memtrain {" + ",".join(COMMANDS) + "} ...", file=sys.stderr)
        for name, (_, what) in COMMANDS.items():
            print(f"  {name}: {what}", file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    import importlib

    importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    main()

"""`src/train.py`: parse the command line, then hand over to the trainer (which validates first)."""
from __future__ import annotations

from typing import Optional

from memtrain.config.args import parse_args
from memtrain.errors import cli_entry


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    from memtrain.train.trainer import train

    train(parse_args(argv))

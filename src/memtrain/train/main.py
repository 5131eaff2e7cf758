"""`src/train.py`: parse the command line, then hand over to the trainer (which validates first)."""
from __future__ import annotations

import warnings
from typing import Optional

from memtrain.config.args import parse_args
from memtrain.errors import cli_entry
from memtrain import startup_gc


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    # DeepSpeed 0.19.8 calls torch.distributed collectives that torch 2.13 deprecates (all_gather_into_tensor,
    # reduce_scatter_tensor): every rank would print the notice, about code the user does not own
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    args = parse_args(argv)  # before the trainer's imports (seconds): --help and a bad flag answer at once
    from memtrain.train.trainer import train  # noqa: PLC0415 the trainer imports torch (seconds): --help and a bad flag answer first

    startup_gc.imports_done()
    train(args)

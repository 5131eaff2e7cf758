"""Entrypoint: `deepspeed src/train.py --deepspeed ds_configs/zero3_ckpt.json [--recipe ...]`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from a checkout without installing

from memtrain import startup_gc  # noqa: E402

startup_gc.hold()  # the imports below run without the collector, then are frozen out of its sight (main)

from memtrain.train import signals  # noqa: E402

signals.install()  # before anything slow: a stop signal during start-up is recorded, not fatal

from memtrain.train.main import main  # noqa: E402
from memtrain.quick_exit import quick_exit  # noqa: E402

if __name__ == "__main__":
    main()
    quick_exit()  # the run is over and written: no seconds of module teardown (memtrain.quick_exit)

"""Run by tests/trainer_runs.py: memtrain's trainer, several runs in one process (plain python for one rank, the real
deepspeed launcher for two): one start-up (interpreter, torch, DeepSpeed, the launcher) for all of them.

`python tests/trainer_runs_worker.py RUNS.json`: RUNS.json is a list of steps, each
  {"argv": [...src/train.py flags...], "grads": path (optional)}: one run of src/train.py's main, or
  {"cut_back": [run_dir, copy, step]}: tests/conftest.py's cut_back of a finished run, made by rank 0 while the
  other ranks wait for it (a stopped run, for the next step to resume).
Before each run, rank 0 prints MARK with the run's index on stdout and stderr, so the test tells the runs' output
apart. With "grads", DeepSpeed's engine.step is wrapped here, in the test's own process: at the first
gradient-accumulation boundary (the last micro-step of step 1, before the optimizer uses them) every rank gathers every
parameter's full gradient (`deepspeed.utils.safe_get_full_grad`, a collective) and rank 0 saves them with torch.save.
Nothing in memtrain's code path is a test hook.
"""
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from memtrain import startup_gc  # noqa: E402

startup_gc.hold()  # as src/train.py does: the imports without the collector, frozen by the first run's main

import torch  # noqa: E402

from memtrain.train import signals  # noqa: E402

signals.install()  # as src/train.py does, first thing

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from memtrain.quick_exit import quick_exit  # noqa: E402
from memtrain.train.main import main  # noqa: E402

MARK = "=== trainer_runs_worker: run "
OUT = {"path": None}
_step = DeepSpeedEngine.step


def step(self, *args, **kwargs):
    if OUT["path"] is not None and self.is_gradient_accumulation_boundary():
        grads = {n: safe_get_full_grad(p).detach().float().cpu().clone()
                 for n, p in self.module.named_parameters() if p.requires_grad}
        if self.global_rank == 0:
            torch.save(grads, OUT["path"])
        OUT["path"] = None  # the first step only
    return _step(self, *args, **kwargs)


DeepSpeedEngine.step = step


def cut_back_on_rank0(run_dir: str, copy: str, step: int) -> None:
    """Rank 0 copies; every other rank waits for its `.ready` file (no process group between runs)."""
    ready = copy + ".ready"
    if os.environ.get("RANK", "0") == "0":
        sys.path.insert(0, HERE)
        from conftest import cut_back

        cut_back(__import__("pathlib").Path(run_dir), __import__("pathlib").Path(copy), step)
        open(ready, "w").close()
        return
    deadline = time.time() + 300
    while not os.path.exists(ready):
        assert time.time() < deadline, f"rank 0 never cut back {run_dir}"
        time.sleep(0.1)


def run_all(steps: list) -> None:
    port = int(os.environ.get("MASTER_PORT", 0))
    runs = 0
    for item in steps:
        if "cut_back" in item:
            cut_back_on_rank0(*item["cut_back"])
            continue
        if os.environ.get("RANK", "0") == "0":
            for stream in (sys.stdout, sys.stderr):
                print(f"{MARK}{runs}", file=stream, flush=True)
        OUT["path"] = item.get("grads")
        if runs and port:  # a fresh rendezvous per run: ranks meeting an earlier run's store were seen to hang
            os.environ["MASTER_PORT"] = str(port + runs)
        main(item["argv"])
        runs += 1
        _close_log_files()
        _forget_compiles()


def _forget_compiles() -> None:
    """dynamo's compiled code, guards and compile counts dropped after a compiled run, as a fresh process has none:
    the next run compiles its own layers and counts its own compiles (memtrain.recompute.compiled)."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _close_log_files() -> None:
    """DeepSpeed's logger back as a fresh process has it: a run's file (memtrain.train.ds_log) gets no later run's
    lines."""
    from deepspeed.utils import logger

    for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        logger.removeHandler(handler)
        handler.close()


if __name__ == "__main__":
    with open(sys.argv[-1]) as f:  # the launcher adds --local_rank before it
        run_all(json.load(f))
    sys.stdout.flush()
    sys.stderr.flush()
    quick_exit()  # as src/train.py ends

"""Run by tests/launch/test_token_loss.py: memtrain's trainer, several runs in one process (plain python for one rank, the
real deepspeed launcher for two), each recording the first optimizer step's full gradients.

`python tests/token_loss_worker.py RUNS.json`: RUNS.json is a list of {"argv": [...src/train.py flags...],
"grads": path}. DeepSpeed's engine.step is wrapped here, in the test's own process, before any run: at the first
gradient-accumulation boundary (the last micro-step of step 1, before the optimizer uses them) every rank gathers
every parameter's full gradient (`deepspeed.utils.safe_get_full_grad`, a collective) and rank 0 saves them with
torch.save. Nothing in memtrain's code path is a test hook.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from memtrain.train import signals  # noqa: E402

signals.install()  # as src/train.py does, first thing

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from memtrain.train.main import main  # noqa: E402

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

if __name__ == "__main__":
    with open(sys.argv[-1]) as f:  # the launcher adds --local_rank before it
        runs = json.load(f)
    port = int(os.environ.get("MASTER_PORT", 0))
    for i, run in enumerate(runs):
        OUT["path"] = run["grads"]
        if i and port:  # a fresh rendezvous per run: ranks meeting an earlier run's store were seen to hang
            os.environ["MASTER_PORT"] = str(port + i)
        main(run["argv"])

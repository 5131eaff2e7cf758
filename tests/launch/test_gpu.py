"""GPU-only: the real trainer through the launcher on every visible GPU (NCCL), stopped once by a signal.

Skipped without CUDA (CI has none); run on a GPU machine with `python -m pytest -q tests/launch/test_gpu.py`.
"""
import json
import signal
import sys
import time

import pytest
import torch

from conftest import FAST, TRAIN, Launch, _workers
from memtrain.train.ports import free_port
from memtrain.tools.tb import read_scalars

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_trainer_on_every_gpu_stops_together_on_one_signal(tmp_path):
    """Every rank on its own GPU (LOCAL_RANK), NCCL collectives on device tensors, the loss read only
    at log boundaries; SIGUSR1 to the last rank alone stops all of them at the same step, saved."""
    ngpus = torch.cuda.device_count()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ngpus), "--master_port",
           str(free_port()), str(TRAIN), *FAST, "--set", "train.log_every=3", "--max-steps", "100000",
           "--run-dir", str(run_dir)]
    with Launch(cmd) as launch:
        proc = launch.proc
        deadline = time.time() + 300
        while not list((run_dir / "tb").glob("events.out.tfevents.*")) or not read_scalars(run_dir / "tb").get(
                "train/loss"):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        _workers(proc)[ngpus - 1].send_signal(signal.SIGUSR1)
        out, err = launch.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stop_signal"] == "SIGUSR1", summary
    assert summary["world_size"] == ngpus
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step{summary['steps']:08d}"  # saved where it stopped
    assert summary["device"] == torch.cuda.get_device_name(0)  # the rank's GPU, not "cpu"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["deepspeed"]["optimizer"]["params"].get("fused") is True  # torch's fused AdamW, no op build
    steps = [s for s, _ in read_scalars(run_dir / "tb")["train/loss"]]
    losses = [v for _, v in read_scalars(run_dir / "tb")["train/loss"]]
    # every 3 steps, plus the step every rank stopped at (within two steps of the signal, the agreement
    # running beside the steps on a gloo group: no boundary needed)
    assert all(v == v for v in losses) and steps[-1] == summary["steps"]
    assert steps[:-1] == list(range(3, summary["steps"], 3)) or steps == list(range(3, summary["steps"] + 1, 3))

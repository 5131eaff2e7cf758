"""A run stopped by a signal and resumed equals an uninterrupted run, bit for bit (2 CPU ranks, launcher).

Attention dropout is on, so every step draws from the torch RNG: a resume that did not restore the
RNG streams would draw other masks and lose bit-equality from the first resumed step."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import FAST, TRAIN, ROOT, _env, _free_port, assert_ok, run_train
from memtrain.train.checkpoint import tag_for
from memtrain.tools.tb import read_scalars

STEPS = 10
ARGS = [*FAST, "--max-steps", str(STEPS), "--set", "train.save_interval=3", "--set", "model.config.attention_dropout=0.2",
        "--deepspeed",
        str(ROOT / "ds_configs" / "zero3_ckpt.json")]


def _workers(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The launcher's training processes by local rank."""
    out = {}
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        rank = next((c.split("=")[1] for c in cmd if c.startswith("--local_rank=")), None)
        if str(TRAIN) in cmd and rank is not None:
            out[int(rank)] = p
    return out


def _preempted_run(run_dir: Path) -> subprocess.CompletedProcess:
    """Launch 2 ranks; once the step-3 checkpoint is complete, SIGTERM rank 1 only (as a scheduler would
    signal some task): every rank must stop together at the next step boundary and save."""
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(_free_port()),
           str(TRAIN), *ARGS, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while not (run_dir / "checkpoints" / tag_for(3)).is_dir():
            assert proc.poll() is None and time.time() < deadline, "run ended before its step-3 checkpoint"
            time.sleep(0.05)
        _workers(proc)[1].send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_stopped_and_resumed_equals_uninterrupted(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert_ok(run_train([*ARGS, "--run-dir", str(whole)], nproc=2))

    stopped = _preempted_run(split)
    assert_ok(stopped)
    summary = json.loads((split / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stop_signal"] == "SIGTERM", summary
    stop_step = summary["steps"]
    assert 3 <= stop_step < STEPS, summary
    assert (split / "checkpoints" / "latest").read_text() == tag_for(stop_step)

    resumed = run_train([*ARGS, "--run-dir", str(split), "--resume"], nproc=2)
    assert_ok(resumed)
    summary = json.loads((split / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert len(list((split / "tb").glob("events.out.tfevents.*"))) == 2  # the resumed run appended its own

    a, b = read_scalars(whole / "tb"), read_scalars(split / "tb")
    assert [s for s, _ in b["train/loss"]] == list(range(1, STEPS + 1))
    assert b["train/loss"] == a["train/loss"]  # exact: same data position, RNG, optimizer state
    assert b["train/lr"] == a["train/lr"]  # schedule and step counter restored

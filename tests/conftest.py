"""Shared helpers: run the real entrypoint (with or without the deepspeed launcher)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "src" / "train.py"
sys.path.insert(0, str(ROOT / "src"))

# Small and fast, but the real model/data/engine path.
FAST = ["--set", "data.seq_len=64", "--set", "train.micro_batch_size=4", "--set", "data.max_bytes=400000",
        "--set", "train.log_every=1"]  # one TensorBoard point per step


def _env() -> dict:
    env = dict(os.environ)
    # this checkout first; keep what the caller's PYTHONPATH adds (e.g. wheels unpacked beside the image)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_train(args: list[str], nproc: int = 0, timeout: int = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """nproc=0: `python src/train.py`; nproc>=1: the real `deepspeed` launcher with nproc CPU ranks."""
    if nproc:
        deepspeed = Path(sys.executable).with_name("deepspeed")
        cmd = [str(deepspeed), "--num_gpus", str(nproc), "--master_port", str(_free_port()), str(TRAIN), *args]
    else:
        cmd = [sys.executable, str(TRAIN), *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.fixture
def ds_config():
    return str(ROOT / "ds_configs" / "zero3_ckpt.json")

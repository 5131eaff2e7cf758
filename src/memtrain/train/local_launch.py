"""make train's ranks on one machine without a GPU, started by memtrain's launcher itself (no torch imported).

DeepSpeed's `deepspeed` runner and its `launch.py` each import torch and DeepSpeed only to start the ranks: 4.4 s each,
one after the other, before any rank starts on the shared 2-core machine (reports/startup.md). Here the launcher gives
each rank what launch.py gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT, CROSS_RANK,
CROSS_SIZE, CUDA_VISIBLE_DEVICES as DeepSpeed's CPU accelerator sets it, `python -u SCRIPT --local_rank=R ARGS`) and
keeps launch.py's rule: a rank that fails ends the others, and its exit code is the launch's. Everything else (a GPU
driver on the machine, a hostfile, CUDA_VISIBLE_DEVICES set, another runner flag) goes through DeepSpeed's runner.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import psutil

HOSTFILE = "/job/hostfile"  # the runner's default --hostfile: a multi-node launch
GPU_SIGNS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")  # an NVIDIA or ROCm driver: DeepSpeed decides
DEFAULT_PORT = 29500  # the runner's default --master_port


@dataclass(frozen=True)
class Local:
    ranks: int
    port: int
    script: str
    args: tuple[str, ...]


def parse(argv: list[str]) -> Optional[Local]:
    """`[--quiet] --num_gpus N [--master_port P] SCRIPT ARGS...` (make train's line); None for any other line."""
    values: dict[str, int] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag, eq, value = argv[i].partition("=")
        i += 1
        if flag == "--quiet" and not eq:
            continue
        if flag not in ("--num_gpus", "--master_port") or flag in values or (not eq and i >= len(argv)):
            return None
        if not eq:
            value, i = argv[i], i + 1
        if not value.isdigit():
            return None
        values[flag] = int(value)
    if values.get("--num_gpus", 0) < 1 or i >= len(argv):
        return None
    return Local(values["--num_gpus"], values.get("--master_port", DEFAULT_PORT), argv[i], tuple(argv[i + 1:]))


def applies(env=os.environ) -> bool:
    """No GPU driver, no hostfile, no device list of the user's: the ranks are CPU ranks on this machine."""
    if env.get("DS_ACCELERATOR", "cpu") != "cpu" or env.get("CUDA_VISIBLE_DEVICES") is not None:
        return False
    return not any(os.path.exists(path) for path in (HOSTFILE, *GPU_SIGNS))


def start(local: Local) -> list[subprocess.Popen]:
    """The ranks, as DeepSpeed's launch.py starts them on one node."""
    n = local.ranks
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(local.port),
           "WORLD_SIZE": str(n), "LOCAL_SIZE": str(n), "CROSS_RANK": "0", "CROSS_SIZE": "1",
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n)))}
    return [subprocess.Popen([sys.executable, "-u", local.script, f"--local_rank={r}", *local.args],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(n)]


def wait(ranks: list[subprocess.Popen]) -> int:
    """0 once every rank has exited 0; at the first that fails, the others (and what they started) are ended and
    its exit code is returned (128 + the signal's number for a rank a signal killed)."""
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is None and None not in codes:
            return 0
        if failed is not None:
            for rank in ranks:
                try:
                    for proc in [*psutil.Process(rank.pid).children(recursive=True), psutil.Process(rank.pid)]:
                        proc.terminate()
                except psutil.Error:  # it has ended already
                    pass
            for rank in ranks:
                rank.wait()
            return failed if failed > 0 else 128 - failed
        time.sleep(0.2)

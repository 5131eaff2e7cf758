"""`make sweep LAUNCHER=slurm`: the sweep's points as one Slurm job array, one point per task.

Each array task runs `slurm/train.sbatch --points FILE` (so a preempted point saves, requeues
itself and resumes, like any memtrain Slurm job). This process waits for the array, then leaves
the same run directories and `summary.json` files as the local launcher, so `make report` reads
them the same way. Resources beyond the per-point ranks come from the usual `SBATCH_*`
variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, SBATCH_CPUS_PER_GPU, ...).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from memtrain.errors import UserError

SBATCH_SCRIPT = Path(__file__).resolve().parents[3] / "slurm" / "train.sbatch"
POLL_S = 2.0


def _run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    except FileNotFoundError:
        raise UserError(f"LAUNCHER=slurm: '{cmd[0]}' not found; run on a Slurm login node") from None
    if proc.returncode != 0:
        msg = " ".join(proc.stderr.split()) or f"exit {proc.returncode}"
        raise UserError(f"LAUNCHER=slurm: {' '.join(cmd[:2])} failed: {msg}")
    return proc.stdout


def cpus_per_gpu(sinfo: str) -> int:
    """The CPUs each GPU can have on every GPU node type of `sinfo -h -o '%c %G'` (CPUs and generic resources per
    node type, e.g. '128 gpu:h100:8(S:0-1)'): the smallest share, at least 1; 0 where no node has GPUs."""
    shares = []
    for line in sinfo.splitlines():
        cpus, _, gres = line.strip().partition(" ")
        gpus = re.search(r"\bgpu(?::[\w.-]+)*:(\d+)", gres)
        if gpus and cpus.isdigit() and int(gpus.group(1)):
            shares.append(max(1, int(cpus) // int(gpus.group(1))))
    return min(shares, default=0)


def resource_args(ranks: int) -> tuple[list[str], dict[str, str]]:
    """One node per point with `ranks` ranks: GPUs where the cluster has them, each with its node's share of the CPUs
    (without a CPU request the partition's default, often 1, would leave the agent and all its ranks one core), else
    CPU ranks. SBATCH_CPUS_PER_GPU or SBATCH_CPUS_PER_TASK, where set, decide instead."""
    share = cpus_per_gpu(_run(["sinfo", "-h", "-o", "%c %G"]))
    if share:
        cpus = [] if {"SBATCH_CPUS_PER_GPU", "SBATCH_CPUS_PER_TASK"} & set(os.environ) else \
            [f"--cpus-per-task={share * ranks}"]
        return [f"--gpus-per-node={ranks}", *cpus], {}
    return [f"--cpus-per-task={ranks}"], {"NPROC_PER_NODE": str(ranks)}


def queued_tasks(array_id: str) -> dict[str, str]:
    """{array index: state} of the array's tasks still in the queue (pending, running, requeued)."""
    proc = subprocess.run(["squeue", "-h", "-r", "-j", array_id, "-o", "%K %T"], capture_output=True, text=True)
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:  # that one: all done and purged
        raise UserError(f"LAUNCHER=slurm: squeue failed: {' '.join(proc.stderr.split())}")
    return dict(line.split() for line in proc.stdout.splitlines() if line.strip())


def task_exit_code(job: str) -> int:
    """A finished task's exit code from `scontrol show job` (kept MinJobAge, 300 s by default)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    found = re.search(r"\bExitCode=(\d+):(\d+)", out)
    if not found:
        return 1
    code, sig = map(int, found.groups())
    return code or (128 + sig if sig else 0)


def run_array(sweep, points, progress) -> None:
    """Submit every point as one array task, wait for all, record each point as it ends."""
    from memtrain.tools.sweep_points import finish_point, last_step, prepare_point, tail  # noqa: PLC0415 pulls pydantic: heavy, imported only when this runs

    listing = sweep.runs_dir / "slurm-points.jsonl"
    listing.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"run_dir": str(p.run_dir), "args": prepare_point(sweep, p)}) for p in points]
    listing.write_text("\n".join(lines) + "\n")
    resources, env = resource_args(sweep.spec.launcher.gpus_per_run)
    logs = sweep.runs_dir / "slurm-%A_%a.out"
    array_id = _run(["sbatch", "--parsable", f"--array=0-{len(points) - 1}", f"--job-name={sweep.name}",
                     f"--output={logs}", *resources, str(SBATCH_SCRIPT), "--points", str(listing)],
                    env).strip().split(";")[0]  # sbatch hands its environment (NPROC_PER_NODE) to the job
    progress.bar.write(f"submitted array job {array_id}: {len(points)} tasks; `scancel {array_id}` stops it")

    pending = dict(enumerate(points))
    try:
        while pending:
            time.sleep(POLL_S)
            states = queued_tasks(array_id)
            running = [i for i in pending if states.get(str(i)) == "RUNNING"]
            if running:  # the bar follows the first running task
                step = last_step(tail(sweep.runs_dir / f"slurm-{array_id}_{running[0]}.out"))
                progress.step(pending[running[0]], f"{len(running)} running, "
                              + ("starting" if step is None else f"step {step}"))
            for index, point in list(pending.items()):
                if str(index) in states:
                    continue
                log = sweep.runs_dir / f"slurm-{array_id}_{index}.out"
                # The task has left the queue: its log becomes the point's stderr.log.
                if log.exists():
                    os.replace(log, point.run_dir / "stderr.log")
                finish_point(sweep, point, task_exit_code(f"{array_id}_{index}"), progress)
                del pending[index]
    except KeyboardInterrupt:
        progress.bar.write(f"array job {array_id} keeps running on the cluster; `scancel {array_id}` stops it")
        raise

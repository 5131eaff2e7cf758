"""slurm/gpus_per_node.sh (ranks per torchrun agent from Slurm's GPU variables) without Slurm:
the functions run with made-up environments, and slurm/train.sbatch runs with stub srun/scontrol."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

HELPER = ROOT / "slurm" / "gpus_per_node.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"


def _run(function: str, **env):
    clean = {"PATH": os.environ["PATH"], **env}  # no Slurm or CUDA variable leaks in from this shell
    return subprocess.run(["bash", "-c", f'source "{HELPER}" && {function}'], env=clean, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("env, gpus", [
    ({}, 0),
    ({"SLURM_GPUS_ON_NODE": "4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:2"}, 4),
    ({"SLURM_JOB_GPUS": "0,1,2"}, 3),
    ({"CUDA_VISIBLE_DEVICES": "GPU-6f1c,GPU-99ab"}, 2),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0),
    ({"SLURM_JOB_GRES": "gpu:4"}, 4),  # --gres=gpu:4, where the old script ran 1 rank per node
    ({"SLURM_GRES": "gpu:a100:4"}, 4),
    ({"SLURM_JOB_GRES": "gpu:a100:4(S:0-1),nic:1"}, 4),
    ({"SBATCH_GRES": "gpu"}, 1),
    ({"SLURM_TRES_PER_NODE": "gres/gpu:2"}, 2),
    ({"SLURM_JOB_GRES": "nic:1"}, 0),  # a --gres without GPUs
    ({"SLURM_GPUS": "8", "SLURM_JOB_NUM_NODES": "2"}, 4),
    # the most direct variable wins over the others
    ({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_JOB_GRES": "gpu:8"}, 2),
    ({"SLURM_GPUS_PER_NODE": "h100:4", "SLURM_JOB_GRES": "gpu:8"}, 4),
])
def test_gpus_per_node(env, gpus):
    proc = _run("gpus_per_node", **env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{gpus}\n", "")
    ranks = _run("ranks_per_agent", **env)
    assert (ranks.returncode, ranks.stdout) == (0, f"{max(gpus, 1)}\n")


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_GRES": "gpu:a100:x"},
    {"SLURM_GPUS_PER_NODE": "h100:four"},
    {"SLURM_GPUS_ON_NODE": "?"},
    {"SLURM_GPUS": "6", "SLURM_JOB_NUM_NODES": "4"},  # --gpus=6 over 4 nodes: no even share
])
def test_gpus_requested_but_not_countable_fails_with_one_line(env):
    for function in ("gpus_per_node", "ranks_per_agent"):
        proc = _run(function, **env)
        assert proc.returncode == 2 and proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("memtrain: error: GPUs were requested"), proc.stderr
        name = next(iter(env))
        assert f"{name}='{env[name]}'" in lines[0] and "NPROC_PER_NODE" in lines[0]


def test_nproc_per_node_wins_and_agents_share_a_node():
    assert _run("ranks_per_agent", NPROC_PER_NODE="3", SLURM_JOB_GRES="gpu:a100:x").stdout == "3\n"
    assert _run("ranks_per_agent", NPROC_PER_NODE="2", SLURM_GPUS_ON_NODE="8").stdout == "2\n"
    bad = _run("ranks_per_agent", NPROC_PER_NODE="two")
    assert bad.returncode == 2 and "NPROC_PER_NODE='two'" in bad.stderr
    assert _run("ranks_per_agent", SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="2").stdout == "4\n"
    odd = _run("ranks_per_agent", SLURM_GPUS_ON_NODE="3", SLURM_NTASKS_PER_NODE="2")
    assert odd.returncode == 2 and "SLURM_NTASKS_PER_NODE" in odd.stderr


@pytest.mark.parametrize("env, nproc, gpus", [
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 4, "4,5,6,7"),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 4, "0,1,2,3"),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 1, "3"),
    ({"SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_LOCALID": "3", "SLURM_GPUS_ON_NODE": "8"}, 2, "6,7"),
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1", "SLURM_JOB_GPUS": "4,5,6,7"}, 2, "6,7"),
    ({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, ""),  # one agent: the node is its own
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}, 1, ""),  # CPU nodes
])
def test_agents_sharing_a_node_get_their_own_gpus(env, nproc, gpus):
    proc = _run(f"agent_gpus {nproc}", **env)
    assert proc.returncode == 0 and proc.stdout.strip() == gpus, proc.stderr


def test_agents_sharing_a_node_need_enough_gpus():
    proc = _run("agent_gpus 4", SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1", CUDA_VISIBLE_DEVICES="0,1,2,3,4")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "need 8 GPUs, the node has 5" in proc.stderr


def _sbatch(tmp_path: Path, **env):
    """train.sbatch with stub scontrol/srun: what torchrun would have been started with."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (stubs / "srun").write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/srun.args"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    slurm = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node1",
             "SLURM_NTASKS": "1", "SLURM_CPUS_ON_NODE": "2", "RUN_DIR": str(tmp_path / "run")}
    path = f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    proc = subprocess.run(["bash", str(SBATCH), "tiny", "ds_configs/zero3_ckpt.json"], cwd=tmp_path,
                          env={"PATH": path, "HOME": str(tmp_path), **slurm, **env},
                          capture_output=True, text=True, timeout=60)
    args = tmp_path / "srun.args"
    return proc, args.read_text() if args.exists() else None


def test_train_sbatch_starts_one_rank_per_gres_gpu(tmp_path):
    proc, srun = _sbatch(tmp_path, SLURM_JOB_GRES="gpu:a100:4")
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node=4" in srun and "1 agent(s) x 4 rank(s)" in proc.stdout


def test_train_sbatch_binds_each_agent_to_its_own_gpus(tmp_path):
    """Two agents sharing a node of 4 GPUs: srun starts each with its SLURM_LOCALID, and the command it runs gives
    each agent's torchrun its own two GPUs (slurm/gpus_per_node.sh agent_gpus through the sbatch's export line)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    seen = tmp_path / "bound"
    (stubs / "scontrol").write_text("#!/bin/sh\necho node1\n")
    # srun: run the step's command (after srun's own --options) once per agent, as Slurm would on the node
    # (the stubs first on PATH again: the sbatch puts the project's venv, with the real torchrun, before them)
    (stubs / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                                f"for id in 0 1; do PATH={stubs}:$PATH SLURM_LOCALID=$id \"$@\"; done\n")
    (stubs / "torchrun").write_text(f'#!/bin/sh\necho "$SLURM_LOCALID=$CUDA_VISIBLE_DEVICES" >> "{seen}"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node1",
           "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "4", "SLURM_GPUS_ON_NODE": "4",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "RUN_DIR": str(tmp_path / "run"),
           "PATH": f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(SBATCH), "tiny", "ds_configs/zero3_ckpt.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert "2 agent(s) x 2 rank(s)" in proc.stdout, proc.stdout + proc.stderr
    assert seen.read_text().splitlines() == ["0=0,1", "1=2,3"]


def test_train_sbatch_stops_when_the_gpu_count_is_unknown(tmp_path):
    proc, srun = _sbatch(tmp_path, SLURM_GPUS_PER_NODE="h100:many")
    assert proc.returncode == 2 and srun is None
    assert proc.stderr.count("\n") == 1 and "SLURM_GPUS_PER_NODE='h100:many'" in proc.stderr


@pytest.mark.parametrize("job_id", ["7", "13000", "19999", "54321"])
def test_train_sbatch_rendezvous_port_is_below_the_ephemeral_range(tmp_path, job_id):
    """The c10d rendezvous port: never inside the kernel's ephemeral range (32768-60999 by default), where an
    outgoing connection on the node may already hold it (20000 + id % 20000 put a third of the job ids there)."""
    ranges = tmp_path / "port_range"
    ranges.write_text("32768\t60999\n")
    proc, srun = _sbatch(tmp_path, SLURM_JOB_ID=job_id, MEMTRAIN_PORT_RANGE_FILE=str(ranges))
    assert proc.returncode == 0, proc.stderr
    port = int(srun.split("--rdzv-endpoint=node1:")[1].split()[0])
    assert 10000 <= port < 32768


def test_train_sbatch_resumes_from_a_complete_step_even_without_latest(tmp_path):
    """A requeued job whose first checkpoint was renamed into place but `latest` not yet written (killed in
    between): the script resumes, as the trainer would from the newest step*, instead of --overwrite setting the
    work aside; a half-written .tmp-step alone is no checkpoint."""
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / ".tmp-step00000004").mkdir(parents=True)
    proc, srun = _sbatch(tmp_path, SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0 and "--overwrite" in srun and "--resume" not in srun
    (checkpoints / "step00000002").mkdir()
    (tmp_path / "srun.args").unlink()
    (tmp_path / "bin").rename(tmp_path / "bin-first")
    proc, srun = _sbatch(tmp_path, SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0 and "--resume" in srun and "--overwrite" not in srun

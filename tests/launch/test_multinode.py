"""`make test-multinode`: two "nodes" on one machine. Two torchrun agents, 2 CPU ranks each, started with the
rendezvous arguments slurm/train.sbatch builds (`--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id JOB-RESTART`): torch's c10d rendezvous lets the second agent on a host join the store the first one
serves, so the 4 ranks see two nodes of 2 local ranks each, as on a cluster.

* ZeRO-3 + full recompute trains 6 steps on 4 ranks and saves, and so does AutoTP 2 (a tensor-parallel pair
  inside each node, data parallel across the nodes), with global rank 0 on the second node: the status is
  in the shared run directory, where the batch script reads it;
* each node with its own run directory (storage that is not shared): every rank stops at start-up with one
  line naming the node that cannot see rank 0's files;
* the same run with one agent killed (SIGKILL to the agent and its ranks, a node lost) after its step-2 model
  checkpoint: the other agent ends within the collective timeout plus a minute, not a hang, and a second
  launch of both agents resumes from the last intact checkpoint to the straight run's losses, exactly.
"""
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import FAST, ROOT, TRAIN, _env
from memtrain.train.ports import free_port
from memtrain.tools.tb import read_scalars
from memtrain.train.checkpoint import tag_for

STEPS = 6
TIMEOUT_S = 30  # train.collective_timeout_s: how long a rank waits for a lost peer
ARGS = [*FAST, "--max-steps", str(STEPS),
        "--set", "train.log_every=1", "--set", "train.save_interval=2", "--set", "train.keep_last=3",
        "--set", f"train.collective_timeout_s={TIMEOUT_S}"]

pytestmark = pytest.mark.multinode


def _agents(run_dir: Path, job: str, logs: Path, extra=(), node_cwds=None,
            ds="zero3_ckpt.json", rank0_node: int = 0) -> list[subprocess.Popen]:
    """Two agents as slurm/train.sbatch's srun starts them, one per "node", each in its own process group.
    `node_cwds`: each node its own working directory, under which a relative `run_dir` is another directory
    (node-local storage: the same path, each node its own disk; the ranks use rank 0's --run-dir string).
    `rank0_node`: the node whose ranks are global ranks 0 and 1. torch's c10d rendezvous numbers the nodes in
    the order of (address, agent pid): on a cluster by host name, so rank 0 need not be on the batch script's
    node; here, on one address, the agent started first."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    cmd = [str(torchrun), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
           str(TRAIN), "--deepspeed", str(ROOT / "ds_configs" / ds), *ARGS, *extra]
    agents = [None, None]
    for i in (rank0_node, 1 - rank0_node):
        log = open(logs / f"{job}-agent{i}.log", "w")
        agents[i] = subprocess.Popen([*cmd, "--run-dir", str(run_dir)], cwd=(node_cwds or [ROOT] * 2)[i],
                                     env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
    return agents


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its ranks: torchrun starts each rank in a session of its own, so the agent's
    process group alone would leave the ranks running (they would finish the run without their agent)."""
    ranks = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == agent.pid:  # the field after the state is the parent's pid
            ranks.append(int(stat.parent.name))
    for pid in [agent.pid, *ranks]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def _running(agents: list[subprocess.Popen]):
    """The agents, each killed with its ranks on leaving the block if it still runs (a failed assertion)."""
    try:
        yield agents
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
                agent.wait()


def _wait(agents, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    try:
        return [a.wait(timeout=max(1.0, deadline - time.time())) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                _kill_node(a)


def _log(logs: Path, job: str) -> str:
    return "\n".join((logs / f"{job}-agent{i}.log").read_text() for i in range(2))


@pytest.mark.parametrize("ds", ["zero3_ckpt.json", "zero3_tp2_ckpt.json"], ids=["zero3", "autotp2"])
def test_two_nodes_train_and_a_lost_node_resumes_to_the_straight_runs_losses(tmp_path, ds):
    """ZeRO-3 + full recompute, and the same with AutoTP 2 (a tensor-parallel group inside each node, data
    parallel across them: its model checkpoint files are named by data- and model-parallel rank)."""
    straight, lost = tmp_path / "straight", tmp_path / "lost"
    # The straight run beside the lost one and its requeue: apart in all but the cores (each job its own
    # rendezvous port, run directory and logs), so the case takes two launches' time, not three.
    # The straight run with global rank 0 on the second node: its status is where the batch script reads it.
    with _running(_agents(straight, "straight-0", tmp_path, ds=ds, rank0_node=1)) as straight_agents:
        with _running(_agents(lost, "lost-0", tmp_path, ds=ds)) as agents:
            deadline = time.time() + 600
            while not (lost / "checkpoints" / tag_for(2)).is_dir():  # renamed into place: complete
                assert all(a.poll() is None for a in agents) and time.time() < deadline, _log(tmp_path, "lost-0")
                time.sleep(0.05)
            _kill_node(agents[1])  # the second node is gone: its agent and both its ranks
            killed = time.time()
            rc = _wait(agents[:1], TIMEOUT_S + 60)[0]
            assert rc != 0 and time.time() - killed < TIMEOUT_S + 60, _log(tmp_path, "lost-0")
            agents[1].wait()
        # the requeue: both agents again, resuming from the newest intact checkpoint
        with _running(_agents(lost, "lost-1", tmp_path, ["--resume"], ds=ds)) as resumed:
            assert _wait(straight_agents, 600) == [0, 0], _log(tmp_path, "straight-0")
            assert _wait(resumed, 600) == [0, 0], _log(tmp_path, "lost-1")
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS and summary["world_size"] == 4, summary
    rank0_lines = [("completed: " in (tmp_path / f"straight-0-agent{i}.log").read_text()) for i in range(2)]
    assert rank0_lines == [False, True], _log(tmp_path, "straight-0")  # rank 0 printed the summary on node 1

    summary = json.loads((lost / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS, summary
    ref = dict(read_scalars(straight / "tb")["train/loss"])
    got = dict(read_scalars(lost / "tb")["train/loss"])
    assert set(got) == set(range(1, STEPS + 1))
    assert got == ref  # exact: same data position, RNG and optimizer state on 4 ranks over two nodes


def test_a_run_directory_the_nodes_do_not_share_is_one_line(tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    agents = _agents(Path("run"), "local-0", tmp_path, node_cwds=nodes)
    assert _wait(agents, 300) != [0, 0]
    out = _log(tmp_path, "local-0")
    lines = [line for line in out.splitlines() if "memtrain: error:" in line]
    assert lines and all("run: not shared between the nodes" in line for line in lines), out[-3000:]
    assert not any((node / "run" / "checkpoints").exists() for node in nodes)  # nothing trained

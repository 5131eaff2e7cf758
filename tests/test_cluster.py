"""Cluster-scale behaviour provable on one machine (2 CPU ranks, the real launcher): the collective timeout is
memtrain's, and work that takes one rank long happens where no collective waits on it."""
from __future__ import annotations

import json

from conftest import FAST, ROOT, assert_ok, run_train, sitecustomize_env

SLOW_PACKING = """
import time
import memtrain.model.data as data
_pack = data._pack
def slow(*args, **kwargs):
    time.sleep(20)  # a corpus that takes longer to pack than the run's collective timeout
    return _pack(*args, **kwargs)
data._pack = slow
"""


def test_packing_longer_than_the_collective_timeout_kills_no_rank(tmp_path):
    """Packing the corpus happens before the ranks meet (they wait on the cache's file lock), so a packing that
    outlasts train.collective_timeout_s (8 s here, a margin for ranks that start seconds apart on shared cores; 20 s
    of packing) still trains. When one rank packed while the
    others waited in an all-gather, this run died of the timeout."""
    env = sitecustomize_env(tmp_path / "site", SLOW_PACKING)
    run = tmp_path / "run"
    proc = run_train([*FAST, "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--max-steps", "2",
                      "--set", "train.collective_timeout_s=8", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                      "--set", "train.save_checkpoints=false", "--run-dir", str(run)], nproc=2, env=env)
    assert_ok(proc)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert len(list((tmp_path / "cache").glob("packed-*.npy"))) == 1 and not list((tmp_path / "cache").glob("*.tmp*"))


def test_cpu_threads_split_the_ranks_cores_where_cpu_work_runs():
    """torchrun sets OMP_NUM_THREADS=1 with several ranks per node; DeepSpeed's CPU Adam (an offloaded optimizer)
    then ran on one core per rank on an 8-GPU node. Where CPU work runs, each rank gets its share of the cores."""
    from memtrain.train.trainer import cpu_threads

    node = {"LOCAL_WORLD_SIZE": "8", "SLURM_CPUS_PER_TASK": "96"}
    assert cpu_threads(cuda=True, host_optimizer=True, env=node) == 12
    assert cpu_threads(cuda=True, host_optimizer=False, env=node) is None  # GPU-only work: torchrun's setting stays
    assert cpu_threads(cuda=False, host_optimizer=False, env=node) == 12
    assert cpu_threads(cuda=False, host_optimizer=False, env={"LOCAL_WORLD_SIZE": "200", "SLURM_CPUS_PER_TASK": "8"}) == 1


def _memory_cgroup(tmp_name: str, limit: int):
    """A child memory cgroup with `limit` bytes (v1 or v2, as root), or None where none can be made here."""
    import os
    from pathlib import Path

    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        group = root / tmp_name
        try:
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(limit))
            return group
        except OSError:
            if group.is_dir():
                try:
                    os.rmdir(group)
                except OSError:
                    pass
    return None


def test_host_memory_is_checked_against_the_nodes_ranks_and_the_cgroup():
    """Before any worker: the ranks on this node x each rank's predicted host bytes (llama-1b's shape cut to 2 layers,
    ZeRO-3 with the optimizer offloaded: 8.9 GiB on this CPU) against what the node can still allocate. The same
    run passes on 1 rank, is one line on 8 ranks (71 GiB > this machine's memory), and is one line on 1 rank in a
    memory cgroup of 4 GiB (a Slurm job's --mem): the cgroup's room counts, not only MemAvailable."""
    import os
    import subprocess
    import sys

    import pytest

    from conftest import _env

    base = [sys.executable, "-m", "memtrain.train.preflight", "--deepspeed", str(ROOT / "ds_configs" / "zero3_offload.json"),
            "--recipe", str(ROOT / "recipes" / "llama-1b.yaml"), "--set", "model.config.num_hidden_layers=2",
            "--set", "data.random_tokens=true"]
    one = subprocess.run([*base, "--world-size", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    eight = subprocess.run([*base, "--world-size", "8"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert eight.returncode == 2 and eight.stderr.count("\n") == 1, eight.stderr
    assert "host memory: 8 rank(s) on this node x" in eight.stderr and "available on" in eight.stderr

    group = _memory_cgroup(f"memtrain-test-{os.getpid()}", 4 << 30)
    if group is None:
        pytest.skip("no memory cgroup can be made here (not root, or no memory controller)")
    try:
        inside = subprocess.run(["bash", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "bash", *base,
                                 "--world-size", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True)
    finally:
        os.rmdir(group)
    assert inside.returncode == 2 and "host memory: 1 rank(s) on this node x 8.9 GiB each" in inside.stderr, \
        inside.stderr

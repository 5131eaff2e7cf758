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
    time.sleep(12)  # a corpus that takes longer to pack than the run's collective timeout
    return _pack(*args, **kwargs)
data._pack = slow
"""


def test_packing_longer_than_the_collective_timeout_kills_no_rank(tmp_path):
    """Packing the corpus happens before the ranks meet (they wait on the cache's file lock), so a packing that
    outlasts train.collective_timeout_s (4 s here; 12 s of packing) still trains. When one rank packed while the
    others waited in an all-gather, this run died of the timeout."""
    env = sitecustomize_env(tmp_path / "site", SLOW_PACKING)
    run = tmp_path / "run"
    proc = run_train([*FAST, "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--max-steps", "2",
                      "--set", "train.collective_timeout_s=4", "--set", f"data.cache_dir={tmp_path / 'cache'}",
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

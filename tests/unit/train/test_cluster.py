"""Cluster-scale behaviour provable on one machine (2 CPU ranks, the real launcher): the collective timeout is
memtrain's, and work that takes one rank long happens where no collective waits on it."""
from __future__ import annotations


from conftest import ROOT


def test_cpu_threads_split_the_ranks_cores_where_cpu_work_runs():
    """torchrun sets OMP_NUM_THREADS=1 with several ranks per node; DeepSpeed's CPU Adam (an offloaded optimizer)
    then ran on one core per rank on an 8-GPU node. Where CPU work runs, each rank gets its share of the cores."""
    from memtrain.train.trainer import cpu_threads

    node = {"LOCAL_WORLD_SIZE": "8", "SLURM_CPUS_PER_TASK": "96"}
    assert cpu_threads(cuda=True, host_optimizer=True, env=node) == 12
    assert cpu_threads(cuda=True, host_optimizer=False, env=node) is None  # GPU-only work: torchrun's setting stays
    assert cpu_threads(cuda=False, host_optimizer=False, env=node) == 12
    assert cpu_threads(cuda=False, host_optimizer=False, env={"LOCAL_WORLD_SIZE": "200", "SLURM_CPUS_PER_TASK": "8"}) == 1


def test_node_errors_print_once_per_node_and_launch(monkeypatch, capsys):
    """Where several ranks of one node meet the same node error (the host-memory check on every rank of an 8-GPU
    node), the first prints it and the rest do not; other words print; rank 0's input errors alone print. In-process:
    every call here has the same parent, as the ranks of one launch have."""
    import os
    import socket

    import pytest

    from memtrain.errors import NodeError, UserError, cli_entry

    @cli_entry
    def fail(error):
        raise error

    words = f"host memory: too little here ({os.getpid()})"
    for rank in ("3", "5"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "8")
        for error in (NodeError(words), NodeError(words + " again"), UserError("recipe.yaml: train.lr: bad")):
            with pytest.raises(SystemExit) as code:
                fail(error)
            assert code.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"memtrain: error: [rank 3 {socket.gethostname()}] {words}",
                                                    f"memtrain: error: [rank 3 {socket.gethostname()}] {words} again"]
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        fail(UserError("recipe.yaml: train.lr: bad"))
    assert capsys.readouterr().err.splitlines() == ["memtrain: error: recipe.yaml: train.lr: bad"]


def test_a_data_path_this_node_cannot_see_is_a_node_error(tmp_path):
    """resolve_run names the recipe in front of a data error; the error stays a NodeError (printed by the rank whose
    node lacks the file, not only by rank 0)."""
    import pytest

    from memtrain.config.args import parse_args
    from memtrain.errors import NodeError
    from memtrain.train.preflight import resolve_run

    with pytest.raises(NodeError, match=r"embedded recipe 'tiny': data.paths\[0\]: '.*' matches no file"):
        resolve_run(parse_args(["--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"),
                              "--set", f"data.paths=[\"{tmp_path / 'node-local' / '*.txt'}\"]"]), 2)

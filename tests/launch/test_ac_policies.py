"""AC policies: same gradients as no recompute (dropout on and off), the activation-memory
ordering they promise, their errors and warnings, `memtrain.tools.ac_profile`, and ZeRO-3 runs."""
import json

import pytest

from conftest import FAST, ROOT, assert_ok
from memtrain.recompute.policy import layer_modes
from trainer_runs import run_in_one_launch
pytestmark = pytest.mark.usefixtures("one_thread")


# sqrt: DeepSpeed's checkpoint (hooked layers). The other policies under ZeRO-3 on 2 ranks, with the trainer's engine
# set-up but without a launch each: tests/launch/test_zero3_hooks.py
ZERO3_RUNS = {"sqrt": []}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """Policies under ZeRO-3 with 2 CPU ranks through the deepspeed launcher: 6 steps each, all in one launch
    (tests/trainer_runs.py), each with its slice of the launch's output."""
    names = {"none": [], **ZERO3_RUNS}
    run_dirs = [tmp_path_factory.mktemp("zero3") / "run" for _ in names]
    steps = [{"argv": ["--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--run-dir", str(run_dir), *FAST,
                       "--max-steps", "6", "--set", f"activation_checkpointing.policy={name.split(',')[0]}", *extra]}
             for run_dir, (name, extra) in zip(run_dirs, names.items())]
    procs = run_in_one_launch(steps, tmp_path_factory.mktemp("runs") / "runs.json")
    assert_ok(procs[-1])
    return {name: (run_dir, proc) for name, run_dir, proc in zip(names, run_dirs, procs)}


@pytest.mark.parametrize("name", ZERO3_RUNS)
def test_policies_under_zero3_match_no_recompute(zero3_runs, name):
    from memtrain.tools.tb import read_scalars

    def summary(run):
        return json.loads((zero3_runs[run][0] / "summary.json").read_text())

    run_dir, proc = zero3_runs[name]
    policy = name.split(",")[0]
    plan = summary(name)["ac_plan"]
    assert summary(name)["status"] == "completed" and summary(name)["world_size"] == 2
    assert plan["layers"] == list(layer_modes(policy, 4))
    # sqrt segments keep ZeRO-3's hooks on every submodule (no leaf layers, memtrain.config.zero3), which
    # backend auto then runs under DeepSpeed's reentrant checkpoint (memtrain.config.recompute_spec)
    assert plan["backend"] == ("deepspeed" if "deepspeed" in name or policy == "sqrt" else "torch")
    assert plan["segments"] == ([[0, 2], [2, 4]] if policy == "sqrt" else [])
    assert f"AC plan: policy '{policy}'" in proc.stdout
    loss = [v for _, v in read_scalars(run_dir / "tb")["train/loss"]]
    ref = [v for _, v in read_scalars(zero3_runs["none"][0] / "tb")["train/loss"]]
    assert len(loss) == 6 and loss == pytest.approx(ref, rel=2e-3, abs=2e-3)  # same gradients, same updates
    act, act_none = (summary(r)["metrics"]["memory/activation_gib"] for r in (name, "none"))
    assert act < act_none


def test_zero3_two_ranks_with_cpu_checkpointing(zero3_runs):
    """memtrain's offload of checkpointed activations on the real ZeRO-3 path (the sqrt run above: the real launcher,
    2 CPU ranks, the default JSON, cpu_checkpointing and partition_activations on, with DeepSpeed's reentrant
    checkpoint): on a CPU run both keys are no-ops, each says why in the plan, and nothing is copied. (The offload's
    scheduling, in process: tests/launch/test_offload.py.)"""
    from memtrain.tools.tb import read_scalars

    run_dir, proc = zero3_runs["sqrt"]
    ac = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())["activation_checkpointing"]
    assert ac["cpu_checkpointing"] is True and ac["partition_activations"] is True
    assert "cpu_checkpointing: a CPU run's activations are already in host memory: no copies, no cost" in proc.stdout
    assert "partition_activations: nothing to shard: no tensor-parallel group" in proc.stdout
    assert "with deepspeed.checkpointing.checkpoint (reentrant)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ac_plan"]["offload"] == [False] * 4
    scalars = read_scalars(run_dir / "tb")
    assert "memory/offloaded_activation_gib" not in scalars  # logged only when memtrain offloads
    loss = [v for _, v in scalars["train/loss"]]
    assert len(loss) == 6 and loss[-1] < loss[0]

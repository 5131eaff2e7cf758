"""AC policies: same gradients as no recompute (dropout on and off), the activation-memory
ordering they promise, their errors and warnings, `memtrain.tools.ac_profile`, and ZeRO-3 runs."""
import json

import pytest

from conftest import FAST, ROOT, assert_ok, run_train
from memtrain.recompute.policy import layer_modes
pytestmark = pytest.mark.usefixtures("one_thread")


# sqrt: DeepSpeed's checkpoint (hooked layers). The other policies under ZeRO-3 on 2 ranks, with the trainer's engine
# set-up but without a launch each: tests/launch/test_zero3_hooks.py
ZERO3_RUNS = {"sqrt": []}


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory):
    """Policies under ZeRO-3 with 2 CPU ranks through the deepspeed launcher: 3 steps each."""
    runs = {}
    for name, extra in {"none": [], **ZERO3_RUNS}.items():
        run_dir = tmp_path_factory.mktemp("zero3") / "run"
        policy = name.split(",")[0]
        proc = run_train(["--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--run-dir", str(run_dir),
                          *FAST, "--max-steps", "3", "--set", f"activation_checkpointing.policy={policy}", *extra],
                         nproc=2)
        assert_ok(proc)
        runs[name] = (run_dir, proc)
    return runs


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
    assert len(loss) == 3 and loss == pytest.approx(ref, rel=2e-3, abs=2e-3)  # same gradients, same updates
    act, act_none = (summary(r)["metrics"]["memory/activation_gib"] for r in (name, "none"))
    assert act < act_none

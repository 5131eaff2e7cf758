"""The step loop syncs with the host only at boundaries: every train.log_every steps (default: the
JSON's steps_per_print, else 10), the end of the metric warm-up, saves and the last step. The per-step run also
shows that WORLD_SIZE left in the environment without a launcher trains one process; the default-cadence run, that
a train.stop_deadline_s too short for a stop warns once (the step time it needs is measured at these boundaries)."""
import json

import pytest

from conftest import FAST, ROOT, _env, assert_ok, run_train
from memtrain.tools.tb import read_scalars

BASE = [*FAST, "--max-steps", "10", "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json")]


@pytest.fixture(scope="module")
def per_step_run(tmp_path_factory):
    """Every step logged (FAST sets train.log_every=1); one process, no launcher, with WORLD_SIZE=2 left in the
    environment by a shell (test_a_world_size_left_in_the_environment_trains_one_process reads the same run)."""
    run_dir = tmp_path_factory.mktemp("every1")
    env = {**_env(), "WORLD_SIZE": "2"}
    env.pop("RANK", None)
    proc = run_train([*BASE, "--run-dir", str(run_dir)], env=env)
    assert_ok(proc)
    return run_dir, proc


@pytest.fixture(scope="module")
def per_step(per_step_run):
    return read_scalars(per_step_run[0] / "tb")


@pytest.fixture(scope="module")
def every4_run(tmp_path_factory):
    """One run for three tests: no train.log_every, the JSON's steps_per_print 4 (the default cadence); a stop
    deadline of 1 ms (test_stop_deadline_warns_once_when_stopping_would_outlast_it)."""
    tmp = tmp_path_factory.mktemp("every4")
    ds = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    ds["steps_per_print"] = 4
    (tmp / "ds.json").write_text(json.dumps(ds))
    i = BASE.index("train.log_every=1")
    args = BASE[:i - 1] + BASE[i + 1:]  # without FAST's --set train.log_every=1
    args[args.index("--deepspeed") + 1] = str(tmp / "ds.json")
    proc = run_train([*args, "--set", "train.stop_deadline_s=0.001", "--run-dir", str(tmp / "run")])
    assert_ok(proc)
    return tmp / "run", proc


@pytest.fixture(scope="module")
def every4(every4_run):
    return every4_run[0]


def test_boundaries_and_interval_means(every4, per_step):
    tb = read_scalars(every4 / "tb")
    # boundaries: the end of the 3-step metric warm-up, every 4th step, the last step
    assert [s for s, _ in tb["train/loss"]] == [3, 4, 8, 10]
    assert [s for s, _ in tb["throughput/tokens_per_s"]] == [4, 8, 10]  # intervals after the warm-up
    losses = dict(per_step["train/loss"])  # the same run, read every step
    for (step, value), start in zip(tb["train/loss"], [0, 3, 4, 8]):
        interval = [losses[s] for s in range(start + 1, step + 1)]
        assert value == pytest.approx(sum(interval) / len(interval), rel=1e-6)
    summary = json.loads((every4 / "summary.json").read_text())
    assert summary["measured_steps"] == 7 and summary["final_loss"] == pytest.approx(losses[10], rel=1e-6)


def test_default_cadence_is_the_json_steps_per_print(every4):
    """No train.log_every: the JSON's steps_per_print (4; zero3_ckpt.json's own is not 4), not every 10 steps."""
    assert json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text()).get("steps_per_print") != 4
    assert [s for s, _ in read_scalars(every4 / "tb")["train/loss"]] == [3, 4, 8, 10]
    assert json.loads((every4 / "config.json").read_text())["deepspeed"]["steps_per_print"] == 4


def test_a_world_size_left_in_the_environment_trains_one_process(per_step_run):
    """WORLD_SIZE=2 left behind by a shell, no launcher: one process trains, with one warning (it used to size the
    batch for 2 ranks and fail inside DeepSpeed's batch assertion)."""
    run_dir, proc = per_step_run
    assert [line for line in proc.stdout.splitlines() if line.startswith("warning:")] == [
        "warning: WORLD_SIZE=2 is set in the environment, but no launcher started this process (no RANK): it trains "
        "as one process (start it with deepspeed or torchrun for more ranks, or unset WORLD_SIZE)"]
    assert json.loads((run_dir / "config.json").read_text())["world_size"] == 1


def test_stop_deadline_warns_once_when_stopping_would_outlast_it(every4_run):
    """train.stop_deadline_s (slurm/train.sbatch passes its --signal lead): measured step time x 2 (+ a save) above
    it is one warning, once. A deadline far above it is quiet: the runs of
    tests/launch/test_faults.py::test_kill_during_save_then_resume_from_previous_good_checkpoint."""
    proc = every4_run[1]
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: a stop signal may arrive")]
    assert len(warnings) == 1, proc.stdout[-2000:]
    assert "0.001 s before the job is killed (train.stop_deadline_s), but stopping takes up to 2 steps" in warnings[0]

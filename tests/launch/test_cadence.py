"""The step loop syncs with the host only at boundaries: every train.log_every steps (default: the
JSON's steps_per_print, else 10), the end of the metric warm-up, saves and the last step."""
import json

import pytest

from conftest import FAST, ROOT, assert_ok, run_train
from memtrain.tools.tb import read_scalars

BASE = [*FAST, "--max-steps", "10", "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json")]


@pytest.fixture(scope="module")
def per_step(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("every1")
    assert_ok(run_train([*BASE, "--run-dir", str(run_dir)]))  # FAST sets train.log_every=1
    return read_scalars(run_dir / "tb")


def test_boundaries_and_interval_means(tmp_path, per_step):
    run_dir = tmp_path / "every4"
    assert_ok(run_train([*BASE, "--set", "train.log_every=4", "--run-dir", str(run_dir)]))
    tb = read_scalars(run_dir / "tb")
    # boundaries: the end of the 3-step metric warm-up, every 4th step, the last step
    assert [s for s, _ in tb["train/loss"]] == [3, 4, 8, 10]
    assert [s for s, _ in tb["throughput/tokens_per_s"]] == [4, 8, 10]  # intervals after the warm-up
    losses = dict(per_step["train/loss"])  # the same run, read every step
    for (step, value), start in zip(tb["train/loss"], [0, 3, 4, 8]):
        interval = [losses[s] for s in range(start + 1, step + 1)]
        assert value == pytest.approx(sum(interval) / len(interval), rel=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["measured_steps"] == 7 and summary["final_loss"] == pytest.approx(losses[10], rel=1e-6)


def test_default_cadence_is_the_json_steps_per_print(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    ds["steps_per_print"] = 5
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    run_dir = tmp_path / "run"
    i = BASE.index("train.log_every=1")
    args = BASE[:i - 1] + BASE[i + 1:]  # without FAST's --set train.log_every=1
    args[args.index("--deepspeed") + 1] = str(tmp_path / "ds.json")
    assert_ok(run_train([*args, "--run-dir", str(run_dir)]))
    assert [s for s, _ in read_scalars(run_dir / "tb")["train/loss"]] == [3, 5, 10]

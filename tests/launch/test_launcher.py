"""The default job through the real `deepspeed` launcher: 2 CPU ranks (gloo), ZeRO-3; then the same job without AC in
the same launch (tests/trainer_runs.py: one start-up for both)."""
import json

import pytest

from conftest import ROOT, assert_ok
from memtrain.tools.tb import read_scalars
from trainer_runs import run_in_one_launch

CONTRACT_TAGS = {
    "train/loss", "train/lr", "throughput/tokens_per_s", "throughput/samples_per_s",
    "throughput/tflops_per_device", "time/step_s", "memory/peak_allocated_gib", "memory/peak_reserved_gib",
    "memory/activation_gib", "memory/host_rss_gib",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The default `make train` job with AC on, and the same job with ZeRO-3 and no AC, in one launch."""
    tmp = tmp_path_factory.mktemp("runs")
    jobs = {"ac": "zero3_ckpt.json", "noac": "zero3_noac.json"}
    procs = run_in_one_launch([{"argv": ["--deepspeed", str(ROOT / "ds_configs" / ds), "--run-dir", str(tmp / name)]}
                               for name, ds in jobs.items()], tmp / "runs.json")
    for proc in procs:
        assert_ok(proc)
    return {name: (tmp / name, proc) for name, proc in zip(jobs, procs)}


def test_default_job_trains_and_writes_run_dir(runs):
    run_dir, proc = runs["ac"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 40 and summary["world_size"] == 2
    assert summary["ac_plan"]["layers"] == ["full"] * 4
    config = json.loads((run_dir / "config.json").read_text())
    assert config["deepspeed"]["zero_optimization"]["stage"] == 3
    assert config["deepspeed"]["train_batch_size"] == 16  # "auto" filled: 8 per rank x 2 ranks
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000040"
    assert "AC plan: policy 'full', 4/4 layers recomputed" in proc.stdout
    assert f"TensorBoard logs: {run_dir / 'tb'} (tensorboard --logdir {run_dir / 'tb'}); model: {run_dir / 'final'}" \
        in proc.stdout
    # a clean run is quiet: the plan, the bar, the summary; no warning about the shipped JSON
    assert not [line for line in proc.stdout.splitlines() if line.startswith("warning:")], proc.stdout
    # ZeRO-3 leaf layers (memtrain.config.zero3); two data-parallel ranks: not resident
    leaf = config["deepspeed"]["zero_optimization"]["leaf_module"]["classes"]
    assert leaf == ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]
    assert "zero3 leaf modules: each LlamaDecoderLayer" in proc.stdout and "zero3 residency" not in proc.stdout


def test_tensorboard_has_every_contract_tag_and_loss_falls(runs):
    scalars = read_scalars(runs["ac"][0] / "tb")
    assert CONTRACT_TAGS <= set(scalars)
    # default cadence (no train.log_every, no steps_per_print): every 10 steps, plus the end of the
    # 3-step metric warm-up; each point is its interval's mean loss
    assert [step for step, _ in scalars["train/loss"]] == [3, 10, 20, 30, 40]
    loss = [v for _, v in scalars["train/loss"]]
    assert loss[-1] < 0.6 * loss[0], loss


def test_recompute_keeps_loss_and_cuts_activation_memory(runs):
    ac, noac = (read_scalars(runs[k][0] / "tb") for k in ("ac", "noac"))
    loss_ac = [v for _, v in ac["train/loss"]]
    loss_noac = [v for _, v in noac["train/loss"]]
    assert loss_ac == pytest.approx(loss_noac, rel=2e-3, abs=2e-3)
    act_ac = json.loads((runs["ac"][0] / "summary.json").read_text())["metrics"]["memory/activation_gib"]
    act_noac = json.loads((runs["noac"][0] / "summary.json").read_text())["metrics"]["memory/activation_gib"]
    assert act_ac < 0.5 * act_noac, (act_ac, act_noac)

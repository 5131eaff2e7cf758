"""A run resumed on another world size (through DeepSpeed's universal checkpoint) continues as a straight run: 2 CPU
ranks -> 1 and 1 -> 2 (make train's launcher starts the 2 ranks), against the TensorBoard losses and learning rates
of an uninterrupted 2-rank run; on another batch, against a plain forward of the checkpoint's weights on the samples
that come next.

The resume keeps the global batch (train.grad_accum_steps scaled), so the next steps read the samples the straight
run read (memtrain.model.order). Observed equal to the last bit on CPU float32 (two micro-batches summed in one
process, or across two ranks by the all-reduce, add the same two terms); asserted to 1e-5 relative, the tolerance a
GPU's other reduction order would need."""
import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import EVAL_PATHS, FAST, MAKE_TRAIN_LAUNCHER, ROOT, assert_ok, run_train
from memtrain.config.args import parse_args
from memtrain.errors import UserError
from memtrain.tools.tb import read_scalars
from memtrain.train import checkpoint, preflight, reshard
from memtrain.train.checkpoint import tag_for
from trainer_runs import run_in_one_launch

STEPS = 8
ARGS = [*FAST, "--max-steps", str(STEPS), "--set", "train.save_interval=3", "--set", "train.keep_last=5",
        "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"),
        # held-out loss every 4 steps over one global batch of rows: the same rows on any world size that keeps it
        "--set", EVAL_PATHS, "--set", "train.eval_every=4", "--set", "train.eval_batches=1"]


def _copy_at(run: Path, copy: Path, step: int) -> Path:
    """The run as it was after its step-`step` checkpoint: later checkpoints, results and TensorBoard gone."""
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").glob("step*"):
        if int(later.name[4:]) > step:
            shutil.rmtree(later)
    for done in ("summary.json", "final", "tb"):
        shutil.rmtree(copy / done, ignore_errors=True) if (copy / done).is_dir() else (copy / done).unlink(True)
    return copy


def _close(a: list, b: list) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(
        math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-12) for (_, x), (_, y) in zip(a, b))


def _line(stdout: str, start: str) -> str:
    found = [line for line in stdout.splitlines() if line.startswith(start)]
    assert len(found) == 1, stdout[-3000:]
    return found[0]


def test_a_run_resumes_on_another_world_size_as_a_straight_run(tmp_path):
    whole = tmp_path / "whole"
    assert_ok(run_train([*ARGS, "--run-dir", str(whole)], nproc=2, launcher=MAKE_TRAIN_LAUNCHER))
    straight = read_scalars(whole / "tb")

    # 2 ranks -> 1 at step 3: converted by rank 0, grad accumulation doubled to keep the global batch. One process
    # (the launcher adds nothing to 1 rank) runs this resume and the other-batch one below (tests/trainer_runs.py):
    # the second resumes a copy of `down` at step 3, made between the two runs, with the universal copy the first
    # made (its conversion reused, not made again)
    down, other = _copy_at(whole, tmp_path / "down", 3), tmp_path / "other-batch"
    resumed, resumed_other = run_in_one_launch([
        {"argv": ["--run-dir", str(down), "--resume"]}, {"cut_back": [str(down), str(other), 3]},
        {"argv": ["--run-dir", str(other), "--resume", "--max-steps", "4", "--set", "train.grad_accum_steps=1"]}],
        tmp_path / "one-rank.json", nproc=0)
    assert_ok(resumed)
    assert _line(resumed.stdout, "resume overrides:") == (
        "resume overrides: recipe: train.grad_accum_steps 1 -> 2 (keeps the global batch on 1 ranks instead of 2; "
        "--set train.grad_accum_steps=N to choose)")
    universal = down / "checkpoints" / tag_for(3) / "universal"
    converted = _line(resumed.stdout, "resume: ")
    assert converted.startswith(f"resume: {tag_for(3)} was saved by 2 ranks, this run has 1: DeepSpeed's universal "
                                f"checkpoint {universal} (converted in ") and converted.endswith(
        " s), loaded with load_universal"), converted
    assert _line(resumed.stdout, "resume data:") == (
        "resume data: 24 samples read in 3 steps; step 4 reads samples [24, 32) (8 a step), as a straight run would")
    after = read_scalars(down / "tb")
    for key in ("train/loss", "train/lr"):
        assert _close(after[key], straight[key][3:]), (key, after[key], straight[key])
    assert _close(after["eval/loss"], straight["eval/loss"]), (after["eval/loss"], straight["eval/loss"])  # 4 and 8
    assert json.loads((down / "checkpoints" / tag_for(6) / "manifest.json").read_text()) == {
        "world_size": 1, "tp_size": 1, "samples": 48}
    # the disk checks size a checkpoint as saved, without its universal copy
    step3 = down / "checkpoints" / tag_for(3)
    assert checkpoint.dir_bytes(step3) == sum(f.stat().st_size for f in step3.iterdir() if f.is_file())

    _refusals(whole, tmp_path)

    # 2 ranks -> 1 at step 3 with another batch (grad_accum 1: 4 samples a step): step 4 reads the samples after the
    # 24 read, [24, 28); measured against the step-3 weights' loss on those rows, computed here (without the shift
    # it would read [12, 16), the rows of step 4 of a straight 4-a-step run)
    assert_ok(resumed_other)
    assert "reusing the conversion made earlier (it took " in _line(resumed_other.stdout, "resume: ")
    assert _line(resumed_other.stdout, "resume data:") == (
        "resume data: 24 samples read in 3 steps; step 4 reads samples [24, 28) (4 a step), the rows a straight run "
        "of this batch reads at step 7")
    [(step, loss)] = read_scalars(other / "tb")["train/loss"]
    expected = _loss_on_samples(other, 24, 4)
    assert step == 4 and math.isclose(loss, expected, rel_tol=1e-5), (loss, expected, _loss_on_samples(other, 12, 4))

    # 1 rank -> 2 at step 6: the preflight (what `make train` runs first) converts; the workers reuse it
    up = _copy_at(down, tmp_path / "up", 6)
    preflight.main(["--world-size", "2", "--run-dir", str(up), "--resume"])
    assert (up / "checkpoints" / tag_for(6) / "universal" / reshard.RECORD).is_file()
    resumed = run_train(["--run-dir", str(up), "--resume"], nproc=2, launcher=MAKE_TRAIN_LAUNCHER)
    assert_ok(resumed)
    assert "reusing the conversion made earlier (it took " in _line(resumed.stdout, "resume: ")
    assert "recipe: train.grad_accum_steps 2 -> 1 (keeps the global batch" in _line(resumed.stdout, "resume overrides:")
    after = read_scalars(up / "tb")
    for key in ("train/loss", "train/lr"):
        assert _close(after[key], straight[key][6:]), (key, after[key], straight[key])
    assert _close(after["eval/loss"], straight["eval/loss"][1:]), (after["eval/loss"], straight["eval/loss"])  # 8


def _loss_on_samples(run: Path, first: int, count: int) -> float:
    """The mean token loss of the step-3 weights (the universal copy's fp32 tensors) on global samples
    [first, first + count), in one plain forward."""
    import torch

    from memtrain.model.build import build_config, build_model
    from memtrain.model.data import build_tokenizer, prepare_data

    recipe = parse_args(["--run-dir", str(run), "--resume"]).recipe
    config = build_config(recipe.model, build_tokenizer(recipe.data.tokenizer).vocab_size, recipe.data.seq_len)
    model = build_model(recipe.model, config).float().eval()
    own = dict(model.named_parameters())
    zero = run / "checkpoints" / tag_for(3) / "universal" / "zero"
    state = {}
    for param in (p for p in zero.iterdir() if p.is_dir()):
        saved = torch.load(param / "fp32.pt", weights_only=False)
        state[param.name] = (saved["param"] if isinstance(saved, dict) else saved).view(own[param.name].shape)
    assert model.load_state_dict(state, strict=False) == ([], [])
    rows = prepare_data(recipe.data, recipe.train.seed).batch(first // count, 0, 0, 1, count, 1)
    with torch.no_grad():
        return model(input_ids=rows, labels=rows).loss.item()


def _refusals(whole: Path, tmp_path: Path) -> None:
    """What cannot resume on another world size is one line (in-process: the preflight's checks)."""
    step_dir = whole / "checkpoints" / tag_for(3)
    recipe = parse_args(ARGS).recipe
    stage3 = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    with pytest.raises(UserError, match=r"saved by 2 ranks, this launch has 1; .* ZeRO stage 3 only .* relaunch with 2"):
        reshard.check(step_dir, 2, 1, recipe, {**stage3, "zero_optimization": {"stage": 2}})
    with pytest.raises(UserError, match=r"without tensor or sequence parallelism only \(tensor_parallel.autotp_size 2"):
        reshard.check(step_dir, 2, 4, recipe, {**stage3, "tensor_parallel": {"autotp_size": 2}})
    nvme = {**stage3, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
    with pytest.raises(UserError, match=r"offload_optimizer.device nvme keeps each rank's optimizer states"):
        reshard.check(step_dir, 2, 1, recipe, nvme)
    old = tmp_path / "old" / tag_for(3)
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"world_size": 2, "tp_size": 1}))  # saved before "samples"
    with pytest.raises(UserError, match=r"saved before memtrain recorded the samples read"):
        reshard.check(old, 2, 1, recipe, stage3)
    # wired into the preflight: 64 samples read by step 8, steps of 5 x 4 samples on one rank do not divide them
    run = tmp_path / "indivisible"
    shutil.copytree(whole, run)
    args = parse_args(["--run-dir", str(run), "--resume", "--max-steps", "10", "--set", "train.grad_accum_steps=5"])
    with pytest.raises(UserError, match=r"saved after 64 samples, which is not a whole number of this launch's steps "
                                        r"of 20 samples \(train.grad_accum_steps 5 x train.micro_batch_size 4 x 1 "):
        preflight.resolve_run(args, 1)

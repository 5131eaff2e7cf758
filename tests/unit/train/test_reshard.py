"""A run resumed on another world size (through DeepSpeed's universal checkpoint) continues as a straight run: 2 CPU
ranks -> 1 and 1 -> 2, real launcher, against the TensorBoard losses and learning rates of an uninterrupted 2-rank run;
on another batch, against a plain forward of the checkpoint's weights on the samples that come next.

The resume keeps the global batch (train.grad_accum_steps scaled), so the next steps read the samples the straight
run read (memtrain.model.order). Observed equal to the last bit on CPU float32 (two micro-batches summed in one
process, or across two ranks by the all-reduce, add the same two terms); asserted to 1e-5 relative, the tolerance a
GPU's other reduction order would need."""
import json

import numpy as np
import pytest

from conftest import EVAL_PATHS, FAST, ROOT
from memtrain.config.args import parse_args
from memtrain.errors import UserError
from memtrain.model import order
from memtrain.train import reshard
from memtrain.train.checkpoint import tag_for

STEPS = 8
ARGS = [*FAST, "--max-steps", str(STEPS), "--set", "train.save_interval=3", "--set", "train.keep_last=5",
        "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"),
        # held-out loss every 4 steps over one global batch of rows: the same rows on any world size that keeps it
        "--set", EVAL_PATHS, "--set", "train.eval_every=4", "--set", "train.eval_batches=1"]


def test_a_resume_on_another_batch_continues_at_the_samples_read():
    """The shift puts step s of a segment resumed at step k after C samples on the samples
    [C + (s - k) * per_step, + per_step) (independent: the global sample numbers, through order.rows); a straight
    run's rows are unchanged (shift 0)."""
    n, seed, micro_batch = 37, 5, 2
    assert order.resumed_shift(0, 0, 8) == 0 and order.resumed_shift(3, 24, 8) == 0
    for k, samples, world, accum in ((3, 24, 1, 1), (3, 24, 2, 3), (5, 40, 4, 1), (4, 24, 1, 2)):
        per_step = world * accum * micro_batch
        shift = order.resumed_shift(k, samples, per_step)
        for s in (k, k + 1, k + 4):
            first = samples + (s - k) * per_step
            assert np.array_equal(order.step_rows(n, seed, s + shift, world, micro_batch, accum),
                                  order.rows(n, seed, first, per_step))
            got = np.concatenate([order.micro_rows(n, seed, s + shift, m, r, world, micro_batch, accum)
                                  for m in range(accum) for r in range(world)])
            assert sorted(got) == sorted(order.rows(n, seed, first, per_step))
    assert order.resumed_shift(3, 24, 20) is None


@pytest.mark.parametrize("tp, sequence, which", [(2, 1, "tensor_parallel.autotp_size 2"),
                                                  (1, 2, "parallel.sequence 2")])
def test_tensor_or_sequence_parallel_on_another_world_is_one_line(tmp_path, tp, sequence, which):
    """A checkpoint of 4 ranks resumed on 8 with AutoTP or Ulysses: one line naming the key, the ranks to relaunch
    with (Ulysses: and the export route), before any worker (the preflight's reshard.check); the same world passes it."""
    recipe = parse_args([*ARGS, "--set", f"parallel.sequence={sequence}"]).recipe
    stage3 = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    ds_config = {**stage3, "tensor_parallel": {"autotp_size": tp}}
    with pytest.raises(UserError) as refused:
        reshard.check(tmp_path / tag_for(3), 4, 8, recipe, ds_config)
    line = str(refused.value)
    assert "\n" not in line and f"({which}: " in line and "relaunch with 4" in line
    assert ("memtrain export RUN --step N" in line and "model.pretrained" in line) == (sequence > 1)  # TP: untested
    reshard.check(tmp_path / tag_for(3), 4, 4, recipe, ds_config)  # no world change: nothing to refuse

"""Dropout under AutoTP (memtrain.train.rng): the ranks of a tensor-parallel group draw the same masks on replicated
activations and their own masks on their shards of the attention heads, through recompute and resume.

One launch of the real `deepspeed` launcher with 2 gloo ranks (tests/tp_dropout_worker.py): every check, a 3-step
trainer run, then the trainer resumed from that run's step-1 model checkpoint. References are independent
of the code under test: a plain single-process copy of the weights seeded with torch.manual_seed, no-recompute
gradients, the other rank's numbers. One line for what cannot be placed is checked in-process (the preflight).
"""
import json
from pathlib import Path

import pytest

from conftest import ROOT, launch_cmd, run_launch
from memtrain.train.checkpoint import tag_for


def _launch(out: Path, *args: str) -> list[dict]:
    proc = run_launch(launch_cmd(ROOT / "tests" / "tp_dropout_worker.py", [str(out), *args]), timeout=900, cwd=out)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """One launch: the checks, the trainer's 3 steps, then a copy of that run cut back to step 1 resumed."""
    out = tmp_path_factory.mktemp("tp_dropout")
    ranks = _launch(out, "all")
    shards = sorted(p.name for p in (out / "run" / "checkpoints" / tag_for(1)).glob("zero_pp_rank_*"))
    return ranks, [{"trainer": r["resumed"]} for r in ranks], shards


def test_tp_group_draws_one_models_residual_masks(tp):
    """Residual dropout 0.1, attention dropout 0: the TP=2 run's loss and gradients (shards gathered) are the
    single process's with the same seed, on both ranks. Seeded by global rank, rank 1 drew other masks."""
    ranks = tp[0]
    for r in ranks:
        row = r["reference"]
        assert row["layout"][0] == 2 and row["installed"] == 0  # nothing drops out on a shard: no fork
        assert row["loss"] == pytest.approx(row["ref_loss"], abs=1e-6), row
        assert row["grad_rel_diff"][0] < 1e-5, row
    assert sorted(r["reference"]["layout"][1] for r in ranks) == [0, 1]  # two TP ranks of one data-parallel rank


def test_sharded_heads_draw_their_own_masks_and_the_residual_stream_stays_one(tp):
    """Attention dropout 0.1 as well: each rank's attention-probability masks (its own heads) differ from the other
    rank's, where the same stream without the forks gives both ranks one pattern; the replicated stream after the
    fork is still one: equal losses."""
    ranks = tp[0]
    a, b = (r["masks"] for r in ranks)
    assert a["installed"] == a["forks"] == 4 and a["count"] == 4  # every layer's attention sublayer
    assert a["unforked_layer0"] == b["unforked_layer0"]  # the check can tell: one stream, one pattern
    assert a["layer0"] != b["layer0"]
    assert 0.05 < sum(a["layer0"]) / a["live"] < 0.15  # about p of the probabilities dropped
    assert a["loss"] == b["loss"]


def test_recompute_replays_the_sharded_masks(tp):
    """Full recompute (DeepSpeed's reentrant checkpoint with partitioned inputs, torch's non-reentrant one) with
    attention and residual dropout: bit-identical gradients to no recompute on each rank."""
    ranks = tp[0]
    for r in ranks:
        row = r["recompute"]
        assert row["grad_max"] > 0
        assert row["grad_max_diff"] == {"deepspeed": 0.0, "torch": 0.0}, row
        assert len(set(row["losses"].values())) == 1, row


def test_trainer_ranks_agree_at_every_step_and_after_resume(tp):
    """src/train.py's trainer, tiny OPT (dropout 0.1, attention dropout 0.1), ZeRO-3 + AutoTP 2 with partitioned
    recompute (ds_configs/zero3_tp2_ckpt.json): the two ranks' losses on the same batch are equal at every step;
    DeepSpeed names its ZeRO shards by data-parallel and model-parallel rank; resumed from step 1's model checkpoint
    (per-rank RNG files, TP-local shapes), steps 2 and 3 are the straight run's: step 3's loss also needs step 2's
    update from the restored optimizer state. (A Llama under AutoTP 2 resumes exactly on two nodes in
    tests/launch/test_multinode.py.)"""
    straight, resumed, shards = tp
    a, b = (r["trainer"] for r in straight)
    assert a["status"] == "completed" and a["forks"] == 4
    assert len(a["losses"]) == 3 and a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert len(set(a["losses"])) == 3
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      "zero_pp_rank_0_mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    ra, rb = (r["trainer"] for r in resumed)
    assert ra["status"] == "completed"
    assert ra["losses"] == rb["losses"] == a["losses"][1:], (ra["losses"], rb["losses"], a["losses"])

"""Tensor parallelism (DeepSpeed AutoTP), partitioned activation checkpoints and ZeRO-3 initialisation.

One launch with 2 gloo ranks (make train's launcher: the checks are not about DeepSpeed's runner) runs every
distributed check (tests/tp_worker.py); the tests below assert on what it measured. References are independent of the
code under test: a single-process plain-torch TP=1 model (clipped like DeepSpeed), a plain
transformers build from the same seed, the analytic size of a hidden state, and a walk of the
autograd graph for what DeepSpeed's checkpoints keep. Bad `autotp_size` values are checked in-process
(the preflight), plus one real subprocess for the one-line message.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from families import AUTOTP_REFUSED, FAMILIES, overrides
from conftest import MAKE_TRAIN_LAUNCHER, ROOT, _env, eval_loss_by_hand, launch_cmd, run_launch

DS = ROOT / "ds_configs" / "zero3_ckpt.json"
SEQ, MBS, HIDDEN, LAYERS = 32, 2, 64, 2  # tests/tp_worker.py's model and batch


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.json"
    proc = run_launch(launch_cmd(ROOT / "tests" / "tp_worker.py", [str(out)], launcher=MAKE_TRAIN_LAUNCHER), timeout=900, cwd=out.parent)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads(out.read_text())
    results["stdout"] = proc.stdout
    return results


def test_zero3_model_gets_transformers_init(tp):
    z = tp["zero_init"]
    for name, std in z["std"].items():
        # same distribution as the plain build (its draws differ: same seed, another order)
        assert std["fixed"] == pytest.approx(std["plain"], rel=0.1, abs=1e-6), name
    # torch's defaults under a bare zero.Init are far off: the check above can tell them apart
    assert z["std"]["model.embed_tokens.weight"]["bare"] > 0.5
    assert z["fixed_loss"] == pytest.approx(z["plain_loss"], abs=0.03)
    assert abs(z["bare_loss"] - z["plain_loss"]) > 0.08


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_matches_tp1(tp, stage):
    """5 AdamW steps of AutoTP=2 (ZeRO-3: built under zero.Init, partitioned + contiguous checkpoints)
    against plain torch at TP=1 on the same batches, clipped at 1.0 as DeepSpeed does by default."""
    row = tp[f"parity_z{stage}"]
    assert (row["tp"], row["dp_size"], row["dp_rank"]) == (2, 1, 0)
    assert row["tp_layers"] >= 7 * LAYERS  # q k v o gate up down per layer (+ lm_head): really sharded
    assert len(row["losses"]) == 5
    for mine, ref in zip(row["losses"], row["ref_losses"]):
        assert abs(mine - ref) < 1e-5, (row["losses"], row["ref_losses"])
    assert len(set(row["ref_losses"])) == 5  # the weights moved


def test_partition_halves_checkpointed_bytes_with_identical_grads(tp):
    p = tp["partition"]
    full = LAYERS * MBS * SEQ * HIDDEN * 4  # one fp32 hidden state per recomputed layer, per rank
    assert p["off"]["graph_bytes"] == full
    assert p["on"]["graph_bytes"] == full // 2 == p["expected_on"]  # the plan line's figure
    assert p["contiguous"]["graph_bytes"] == full // 2  # contiguous_memory_optimization + synchronize
    # + cpu_checkpointing: DeepSpeed's own CPU_CHECKPOINT holds each partition (memtrain's offload stands aside)
    assert p["cpu"]["graph_bytes"] == full // 2 and p["cpu_offload_impl"] == "deepspeed"
    # memory/activation_gib sees what DeepSpeed keeps on its autograd context (hooks cannot)
    assert p["off"]["meter_bytes"] - p["on"]["meter_bytes"] == full // 2
    assert p["grad_count"] >= 7 * LAYERS
    # DeepSpeed's non-reentrant checkpoint partitions alike: counted through the meter (no graph node)
    assert p["nonreentrant_off"]["meter_bytes"] - p["nonreentrant"]["meter_bytes"] == full // 2
    assert p["nonreentrant"]["meter_bytes"] == p["on"]["meter_bytes"]
    for name in ("off", "on", "contiguous", "cpu", "nonreentrant_off", "nonreentrant"):
        assert p["grad_max_diff"][name] == 0.0, name  # bit-identical to no recompute
    # the pitfall: configured without the group (as before initialize), DeepSpeed shards nothing
    assert p["no_mpu"]["graph_bytes"] == full


def test_planner_divides_what_tp_shards(tp):
    """The memory model's TP=2 rank (fake tensors, no DeepSpeed) against the real TP=2 rank's shards
    and measured activation bytes; TP=1 predicts more, so the division is what makes them agree."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tp_worker  # its model and batch shape

    from memtrain.memory.predict import predict
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.states import model_states
    from memtrain.memory.target import Target

    p = tp["partition"]

    def predicted(tp_size, partition, mode):
        target = Target("cpu", "float32", MBS, SEQ, 2, tp=tp_size, partition=partition)
        profile = profile_activations(tp_worker.CONFIG, target)
        states = model_states(profile, {"zero_optimization": {"stage": 0}}, target)
        return profile, predict(profile, states, (mode,) * LAYERS)

    profile, keep = predicted(2, False, "keep")
    assert profile.num_params == p["local_params"]  # q/k/v/o, gate/up/down and the LM head sharded
    assert keep.saved_activations == p["none"]["meter_bytes"]
    assert predicted(1, False, "keep")[1].saved_activations > 1.2 * p["none"]["meter_bytes"]
    for name, partition in (("off", False), ("on", True)):
        saved = predicted(2, partition, "full")[1].saved_activations
        assert saved == pytest.approx(p[name]["meter_bytes"], rel=0.01), name
    assert (predicted(2, False, "full")[1].saved_activations - predicted(2, True, "full")[1].saved_activations
            == LAYERS * MBS * SEQ * HIDDEN * 4 // 2)


def test_configure_needs_initialize_first(tp):
    assert "after deepspeed.initialize" in tp["configure_guard"]


@pytest.mark.parametrize("which", ["hidden_states", "hidden_states_nonreentrant"])
def test_output_hidden_states_survive_partitioning(tp, which):
    h = tp[which]
    assert h["shapes"] == [[MBS, SEQ, HIDDEN]] * (LAYERS + 1)
    assert h["max_diff"] == 0.0


def test_trainer_counts_each_token_once(tp):
    """TP=2 on 2 ranks is one data-parallel rank: one micro-batch of 4 x 64 tokens per step."""
    m = tp["trainer"]["metrics"]
    assert tp["trainer"]["status"] == "completed"
    assert m["throughput/tokens_per_s"] * m["time/step_s"] == pytest.approx(4 * 64, rel=1e-6)
    assert m["throughput/samples_per_s"] * m["time/step_s"] == pytest.approx(4, rel=1e-6)
    assert m["memory/activation_gib"] > 0
    assert ("partition_activations: on, checkpointed inputs sharded across the tensor-parallel group of 2: "
            f"{4 * 64 * 128 * 4 * 4 // 2:,} B per rank per micro-batch instead of {4 * 64 * 128 * 4 * 4:,} B"
            in tp["stdout"])
    assert math.isfinite(m["train/loss"])
    # the held-out loss under AutoTP (one data rank: 2 eval batches of 4 rows) is final/'s, computed by hand
    summary = json.loads((Path(tp["trainer"]["run_dir"]) / "summary.json").read_text())
    by_hand, positions = eval_loss_by_hand(Path(tp["trainer"]["run_dir"]) / "final", 64, 2 * 4)
    assert summary["eval_tokens"] == positions and abs(summary["eval_loss"] - by_hand) < 1e-5, (summary, by_hand)


def test_parallel_groups_wait_no_longer_than_the_world(tp):
    """DeepSpeed's tensor- and data-parallel groups time out with train.collective_timeout_s (77 s here), not
    torch's 30-minute default for a new group: a lost peer ends the run as fast in any group."""
    timeouts = tp["trainer"]["group_timeouts_s"]
    assert timeouts and set(timeouts) == {77.0}, timeouts


@pytest.mark.parametrize("stage", [1, 3])
def test_tp_final_model_is_whole_and_trained(tp, stage):
    """final/ (memtrain.train.final.save_final, as the trainer writes it) of a TP=2 engine holds the whole
    weights, DeepSpeed gathering the TP shards (and ZeRO-3's partitions), equal to the TP=1 reference
    trained in lock-step; not rank 0's shard."""
    final = tp[f"parity_z{stage}"]["final"]
    assert final["keys_match"] and final["shapes_match"], final
    assert final["max_abs_diff"] < 5e-4, final  # 5 AdamW steps at lr 1e-2 in lock-step; weights are ~0.02


# --------------------------------------------------------------------------- bad autotp_size: one line

def _ds(tmp_path, tensor_parallel):
    cfg = json.loads(DS.read_text())
    cfg["tensor_parallel"] = tensor_parallel
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_bad_autotp_size_subprocess(tmp_path):
    """The real command: one stderr line, exit 2, nothing else."""
    proc = subprocess.run([sys.executable, "-m", "memtrain.train.preflight", "--world-size", "2",
                           "--deepspeed", _ds(tmp_path, {"autotp_size": 3})],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"memtrain: error: {tmp_path / 'ds.json'}: tensor_parallel.autotp_size: 3 does not divide the world size 2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_autotp_takes_trains_as_tp1(tp, family):
    """AutoTP=2 under ZeRO-3 (full recompute, partitioned checkpoints) against a plain TP=1 copy, 2 AdamW steps in
    lock-step (tp_worker.check_families); a family AutoTP cannot shard is one line naming why, before workers."""
    from memtrain.config.args import parse_args
    from memtrain.errors import UserError
    from memtrain.train.preflight import resolve_run

    argv = ["--deepspeed", str(ROOT / "ds_configs" / "zero3_tp2_ckpt.json"),
            *sum((["--set", o] for o in [*overrides(family), "data.random_tokens=true"]), [])]
    if family in AUTOTP_REFUSED:
        with pytest.raises(UserError, match=rf"tensor_parallel.autotp_size: DeepSpeed's AutoTP .*{AUTOTP_REFUSED[family]}"):
            resolve_run(parse_args(argv), 2)
        return
    resolve_run(parse_args(argv), 2)
    row = tp["families"][family]
    assert row["tp_layers"] > 0
    assert row["losses"] == pytest.approx(row["ref_losses"], rel=1e-4), row

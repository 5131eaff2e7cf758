"""Faults: a kill in the middle of a save, a NaN loss, an out-of-memory error."""
import json
import re
import signal
import subprocess
import sys

import pytest

from conftest import _env, all_finite, kill_in_save_env, poison_after_step_env, FAST, ROOT, assert_ok, run_train
from memtrain.train.checkpoint import tag_for
from memtrain.tools.tb import read_scalars


def _losses_per_file(tb_dir):
    """{events file: {step: loss}}, oldest file first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        out[f.name] = {e.step: e.value for e in acc.Scalars("train/loss")}
    return list(out.values())


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A 6-step run SIGKILLed as it renames step 4's model checkpoint into place, then resumed to its end: (run
    directory, the killed run, what the run directory held between the two runs, the resumed run). The finished run
    is also test_a_full_disk_is_one_line_and_loses_nothing's run to resume (copied: this one stays as it is)."""
    tmp_path = tmp_path_factory.mktemp("killed")
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    # a stop deadline far above two steps and a save: both runs stay quiet (tests/launch/test_cadence.py
    # test_stop_deadline_warns_once...: a deadline too short warns)
    args = [*FAST, "--max-steps", "6", "--set", "train.save_interval=2", "--set", "train.stop_deadline_s=3600",
            "--run-dir", str(run)]
    env = kill_in_save_env(tmp_path, 4)  # SIGKILL after step 4's shards are written, as they are renamed
    killed = run_train(args, env=env)
    between = {"partial": (checkpoints / f".tmp-{tag_for(4)}").is_dir(), "step 4": (checkpoints / tag_for(4)).exists(),
               "latest": (checkpoints / "latest").read_text() if (checkpoints / "latest").is_file() else None}
    resumed = run_train([*args, "--resume"])
    return run, killed, between, resumed


def test_kill_during_save_then_resume_from_previous_good_checkpoint(killed_and_resumed):
    run, killed, between, resumed = killed_and_resumed
    checkpoints = run / "checkpoints"
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert between["partial"] and not between["step 4"]
    assert between["latest"] == tag_for(2)  # never points at the partial save

    assert_ok(resumed)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert not list(checkpoints.glob(".tmp-*")) and (checkpoints / "latest").read_text() == tag_for(6)
    first, second = _losses_per_file(run / "tb")
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4, 5, 6]  # resumed after step 2
    assert [second[3], second[4]] == [first[3], first[4]]  # and recomputed steps 3-4 exactly
    assert [s for s, _ in read_scalars(run / "tb")["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert "warning: a stop signal may arrive" not in killed.stdout + resumed.stdout


def test_nan_loss_stops_with_step_last_good_checkpoint_and_hint(tmp_path):
    """GPT-2's LayerNorm turns weights blown up by lr=1e6 into a NaN loss within a few steps.

    The run directory holds an older run, replaced with --overwrite: none of it may remain."""
    run = tmp_path / "run"
    stale_events = run / "tb" / "events.out.tfevents.0.stale"
    stale_events.parent.mkdir(parents=True)
    stale_events.write_bytes(b"")
    (run / "checkpoints" / tag_for(99)).mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "completed"}')
    proc = run_train(["--recipe", str(ROOT / "recipes" / "gpt2-small.yaml"), *FAST, "--max-steps", "12",
                      "--set", "train.save_interval=2", "--set", "train.lr=1e6", "--set", "train.warmup_steps=1",
                      "--run-dir", str(run), "--overwrite"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "memtrain: error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    m = re.search(r"memtrain: error: loss is (nan|inf|-inf) at step (\d+) of 12; last good checkpoint: (\S+) "
                  r"\(kept; continue from it with --resume --run-dir (\S+)\); hint: lower train.lr \(now 1e\+06\)",
                  errors[0])
    assert m, errors[0]
    step, good = int(m.group(2)), m.group(3)
    assert good == str(run / "checkpoints" / tag_for(2 * ((step - 1) // 2)))  # the last save before the NaN
    assert sorted(p.name for p in (run / "checkpoints").glob("step*"))[-1] == tag_for(2 * ((step - 1) // 2))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == step - 1
    assert summary["reason"] == errors[0].split("memtrain: error: ", 1)[1]
    assert summary["last_checkpoint"] == good
    assert not stale_events.exists() and not (run / "checkpoints" / tag_for(99)).exists()
    assert all_finite(run / "checkpoints" / tag_for(2 * ((step - 1) // 2)))  # "good" is good


def test_nonfinite_weights_are_never_saved(tmp_path):
    """Weights that turn NaN in step 2's update, while step 2's loss was still finite: the save after step 2
    refuses, the run fails with one line, and "last good" names step 1, whose every tensor is finite."""
    run = tmp_path / "run"
    proc = run_train([*FAST, "--max-steps", "6", "--set", "train.save_interval=1", "--run-dir", str(run)],
                     env=poison_after_step_env(tmp_path, 2))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "memtrain: error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("memtrain: error: weights are not finite after step 2 of 6 (NaN/inf in the "
                                "parameters), so step 2 was not saved; last good checkpoint: "
                                f"{run / 'checkpoints' / tag_for(1)}"), errors[0]
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == [tag_for(1)]
    assert (run / "checkpoints" / "latest").read_text() == tag_for(1)
    assert all_finite(run / "checkpoints" / tag_for(1))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == errors[0].split("memtrain: error: ", 1)[1]


def test_out_of_memory_advice_uses_the_limit_that_binds(tmp_path):
    """Under `ulimit -v` (RLIMIT_AS) of 6 GiB the report and the planner's advice use 6 GiB, not the machine's RAM."""
    script = (
        "import json, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))\n"
        "from memtrain.config.recipe import load_recipe\n"
        "from memtrain.train.faults import RunPosition, oom_message\n"
        "ds = json.loads(open(sys.argv[1]).read())\n"
        "print(oom_message(RunPosition(world=1, rank=0, run_dir=None), load_recipe(None, []), ds))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "ds_configs" / "zero3_ckpt.json")], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "of 6.00 GiB (RLIMIT_AS, ulimit -v)" in line, line
    assert "memory_budget=6.0" in line or "> 6.0 GiB" in line, line  # the planner's advice, for that limit


def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path, small_disk, killed_and_resumed):
    """On a real 64 MiB tmpfs: a finished run with model checkpoints at steps 4 and 6 (killed_and_resumed's, copied).
    With less free space than one checkpoint: --resume says so in one line before any worker starts, leaving the run
    as it was; a new run's first save is refused before anything is written (one line, no partial save, summary.json
    failed)."""
    import shutil

    from conftest import fill

    disk = small_disk(64)
    run = disk / "run"
    args = [*FAST, "--set", "train.save_interval=1"]
    assert_ok(killed_and_resumed[3])
    shutil.copytree(killed_and_resumed[0], run)
    size = sum(f.stat().st_size for f in (run / "checkpoints" / tag_for(6)).rglob("*") if f.is_file())
    fill(disk, size // 2)
    before = {str(p): p.stat().st_mtime_ns for p in run.rglob("*")}

    resumed = run_train([*args, "--max-steps", "8", "--run-dir", str(run), "--resume"])
    assert resumed.returncode != 0 and "Traceback" not in resumed.stderr
    errors = [line for line in resumed.stderr.splitlines() if "memtrain: error:" in line]
    assert len(errors) == 1 and f"--resume: disk full: {run / 'checkpoints'} has" in errors[0], resumed.stderr[-2000:]
    assert f"(the size of {tag_for(6)}, which stays intact); free space first" in errors[0]
    assert {str(p): p.stat().st_mtime_ns for p in run.rglob("*")} == before

    fresh = disk / "fresh"
    failed = run_train([*args, "--max-steps", "3", "--run-dir", str(fresh)])
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    errors = [line for line in failed.stderr.splitlines() if "memtrain: error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "memtrain: error: disk full: the model checkpoint of step 1 needs about "), errors[0]
    assert f"in {fresh / 'checkpoints'}, which has" in errors[0] and "no earlier model checkpoint" in errors[0]
    assert not (fresh / "checkpoints").exists() or not any((fresh / "checkpoints").iterdir())
    summary = json.loads((fresh / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == errors[0].split("memtrain: error: ", 1)[1]


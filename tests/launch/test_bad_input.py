"""Every bad input is one stderr line naming the file and key path, exit 2, before any worker starts.

Most cases call the preflight check in-process (`memtrain.train.preflight.main`, the same `resolve_run`
the trainer calls in every worker); two go through real subprocesses to show there is exactly
one line and no traceback, and that no run directory appears.
"""
import json
import subprocess
import sys

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees

from conftest import ROOT, _env, run_train

DS = ROOT / "ds_configs" / "zero3_ckpt.json"


def _ds(tmp_path, edit, name="ds.json"):
    """A copy of the default DeepSpeed JSON with `edit(cfg)` applied."""
    cfg = json.loads(DS.read_text())
    edit(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_one_line_no_traceback_no_worker(tmp_path):
    """Through real processes: the preflight `make train` runs, and the trainer itself."""
    path = _ds(tmp_path, lambda c: c["zero_optimization"].update(stage=5))
    pre = subprocess.run([sys.executable, "-m", "memtrain.train.preflight", "--world-size", "2", "--deepspeed", path],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert pre.returncode == 2
    assert pre.stderr.strip().splitlines() == [
        f"memtrain: error: {path}: zero_optimization.stage: 5 is not a ZeRO stage; allowed: 0, 1, 2, 3"]
    run = tmp_path / "run"
    proc = run_train(["--deepspeed", path, "--run-dir", str(run)], timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == pre.stderr.strip().splitlines()
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run.exists()


def test_make_passes_budget_as_one_argument():
    """`--budget -1GB` would read as a flag; the Makefile writes `--budget="$(BUDGET)"`."""
    for target in ("plan", "report"):
        out = subprocess.run(["make", "-n", "-o", "setup", "-o", ".venv/.installed", target, "BUDGET=-1GB"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60).stdout
        assert '--budget="-1GB"' in out, out


# WORLD_SIZE left in the environment without a launcher: tests/launch/test_cadence.py reads it off the run it makes

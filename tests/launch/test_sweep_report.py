"""Sweep runner and report: the report on TensorBoard files written here, and a real 2-point sweep."""
import csv
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT

DS = str(ROOT / "ds_configs" / "zero3_ckpt.json")


def _sweep_file(tmp_path, grid, set_=None, name="s"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"deepspeed": DS, "set": set_ or {}, "grid": grid}))
    return path


def test_report_of_a_sweep_that_never_ran_is_one_line(tmp_path, monkeypatch, capsys):
    """`python -m memtrain report`'s entry point, called in this process (the command starts nothing)."""
    from memtrain.__main__ import main

    monkeypatch.chdir(tmp_path)
    path = _sweep_file(tmp_path, {"train.micro_batch_size": [2, 4]})
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(["report", str(path)])
    err = capsys.readouterr().err
    assert (stopped.value.code, err.strip().splitlines()) == (2, [
        f"memtrain: error: {path}: no point of sweep 's' has run (runs/s holds none of its 2 points); run them first: "
        f"make sweep SWEEP={path}"]), err
    assert not (tmp_path / "reports").exists()


def test_two_point_sweep_end_to_end_with_one_failure(tmp_path, monkeypatch):
    """Real launcher (make train's: memtrain.train.launch), 2 CPU ranks per point; the second point's policy is
    rejected by the trainer. The report of it: `python -m memtrain report`'s entry point, in this process."""
    fast = {"data.seq_len": 32, "data.max_bytes": 200000, "data.cache_dir": str(ROOT / ".cache" / "memtrain"),
            "train.micro_batch_size": 2, "train.max_steps": 4, "train.metric_warmup_steps": 1}
    path = _sweep_file(tmp_path, {"activation_checkpointing.policy": ["full", "bogus"]}, set_=fast, name="e2e")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONWARNINGS": "ignore"}

    def run(*args):
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the sweep stops its launcher too; a kill would leave the ranks running
            out, err = proc.communicate()
            pytest.fail(f"timed out\n{out[-2000:]}\n{err[-2000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    proc = run("memtrain.tools.sweep", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 points, 0 already finished, 2 to run" in proc.stdout
    assert "policy=full: completed" in proc.stdout and "policy=bogus: failed" in proc.stdout
    failed = json.loads((tmp_path / "runs/e2e/policy=bogus/summary.json").read_text())
    assert failed["status"] == "failed" and failed["returncode"] != 0
    assert "activation_checkpointing.policy" in failed["reason"] and "bogus" in failed["reason"]
    # make train's launcher started the CPU ranks itself: DeepSpeed's runner (which logs its launch.py line) never ran
    assert not [log for log in ("stdout.log", "stderr.log")
                if "deepspeed.launcher.launch" in (tmp_path / "runs/e2e/policy=full" / log).read_text()]

    started = time.time()
    again = run("memtrain.tools.sweep", str(path))  # resumable: both points already finished
    assert again.returncode == 0 and "2 already finished, 0 to run" in again.stdout, again.stdout
    assert time.time() - started < 30

    from memtrain.__main__ import main

    monkeypatch.chdir(tmp_path)
    main(["report", str(path), "--budget", "1GiB"])  # returns: no SystemExit
    rows = list(csv.DictReader(open(tmp_path / "reports/e2e/summary.csv")))
    assert [(r["policy"], r["status"]) for r in rows] == [("full", "completed"), ("bogus", "failed")]
    ok, bad = rows
    assert float(ok["tokens_per_s"]) > 0 and float(ok["activation_gib"]) > 0 and ok["pareto"] == "True"
    assert ok["steps"] == "4" and float(ok["final_loss"]) > 0
    assert bad["reason"] == failed["reason"] and bad["tokens_per_s"] == ""
    md = (tmp_path / "reports/e2e/summary.md").read_text()
    assert "`policy=full`" in md.splitlines()[0] and "| bogus | failed |" in md

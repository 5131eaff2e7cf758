"""Sweep runner and report: the report on TensorBoard files written here, and a real 2-point sweep."""
import csv
import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT, _env
from memtrain.errors import UserError
from memtrain.units import parse_size
from memtrain.tools.report import after_warmup_medians, gather, write_report
from memtrain.tools.sweep_points import (failure_reason, is_finished, load_sweep, prepare_point, record_outcome, train_args)
from memtrain.tools.tb import read_scalars

DS = str(ROOT / "ds_configs" / "zero3_ckpt.json")


def _sweep_file(tmp_path, grid, set_=None, name="s"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"deepspeed": DS, "set": set_ or {}, "grid": grid}))
    return path


def _write_events(tb_dir, memory, tokens_per_s, steps=6, warmup=3, eval_every=None):
    """Steps 1..steps: loss/memory every step, throughput/time only after `warmup` (as the trainer); with
    eval_every, a held-out loss of 20 - step every eval_every steps."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tb_dir))
    for step in range(1, steps + 1):
        w.add_scalar("train/loss", 10.0 - step, step)
        w.add_scalar("memory/peak_allocated_gib", memory + (100.0 if step <= warmup else step * 0.25), step)
        w.add_scalar("memory/activation_gib", memory / 2, step)
        if step > warmup:
            w.add_scalar("throughput/tokens_per_s", tokens_per_s + step, step)
            w.add_scalar("time/step_s", 0.5 * step, step)
        if eval_every and step % eval_every == 0:
            w.add_scalar("eval/loss", 20.0 - step, step)
    w.close()


def _summary(run_dir, status, reason=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": status, **({"reason": reason} if reason else {})}))


def test_medians_are_over_steps_after_warmup_and_final_loss_is_last(tmp_path):
    _write_events(tmp_path / "tb", memory=2.0, tokens_per_s=100.0)
    med = after_warmup_medians(read_scalars(tmp_path / "tb"))
    assert med["throughput/tokens_per_s"] == 105.0  # steps 4, 5, 6: 104, 105, 106
    assert med["time/step_s"] == 2.5
    assert med["memory/peak_allocated_gib"] == 3.25  # warm-up steps (102 GiB) left out: 3.0, 3.25, 3.5
    assert med["memory/activation_gib"] == 1.0
    assert med["train/loss"] == statistics.median([6.0, 5.0, 4.0])


def test_report_rows_pareto_failures_and_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(_sweep_file(tmp_path, {"activation_checkpointing.policy": ["none", "full"],
                                              "train.micro_batch_size": [4, 8, 16]}))
    by = {(p.values["activation_checkpointing.policy"], p.values["train.micro_batch_size"]): p for p in sweep.points}
    # (memory at step 4..6 = m + 1, m + 1.25, m + 1.5 -> median m + 1.25; tokens/s median t + 5)
    measured = {("none", 4): (1.0, 200.0), ("full", 4): (0.0, 100.0), ("full", 8): (1.0, 150.0),
                ("full", 16): (2.0, 140.0)}
    for key, (m, t) in measured.items():
        _write_events(by[key].run_dir / "tb", memory=m, tokens_per_s=t, eval_every=3 if key == ("full", 8) else None)
        _summary(by[key].run_dir, "completed")
    _summary(by[("none", 8)].run_dir, "oom", "CUDA out of memory at step 1")
    _summary(by[("none", 16)].run_dir, "failed", "RuntimeError: boom")

    out = write_report(sweep, budget=2.0)
    rows = {(r["policy"], r["micro_batch_size"]): r for r in csv.DictReader(open(out / "summary.csv"))}
    assert len(rows) == 6
    assert float(rows[("full", "8")]["tokens_per_s"]) == 155.0
    assert float(rows[("full", "8")]["peak_allocated_gib"]) == 2.25
    assert float(rows[("full", "8")]["final_loss"]) == 4.0
    assert float(rows[("full", "8")]["eval_loss"]) == 14.0 and rows[("full", "4")]["eval_loss"] == ""  # the last eval
    # Pareto over (memory down, tokens/s up): (1.25, 105) (2.25, 155) (2.25, 205) (3.25, 145)
    assert {k for k, r in rows.items() if r["pareto"] == "True"} == {("full", "4"), ("none", "4")}
    assert rows[("none", "8")]["status"] == "oom" and rows[("none", "8")]["reason"] == "CUDA out of memory at step 1"
    assert rows[("none", "16")]["status"] == "failed" and rows[("none", "16")]["tokens_per_s"] == ""

    md = (out / "summary.md").read_text().splitlines()
    assert md[0].startswith("**Best point under BUDGET=2 GiB**") and "`policy=full,micro_batch_size=4`" in md[0]
    assert any(line.startswith("| none | 8 | oom |") and "CUDA out of memory at step 1" in line for line in md)
    assert any(line.startswith("| none | 16 | failed |") and "RuntimeError: boom" in line for line in md)
    assert (out / "throughput_vs_memory.png").stat().st_size > 10_000
    assert (out / "activation_memory.png").stat().st_size > 10_000
    assert (out / "eval_loss.png").stat().st_size > 10_000  # the one point that evaluated, as a curve
    header = next(line for line in md if line.startswith("| policy"))
    assert "| final loss | eval loss |" in header
    assert any(line.startswith("| full | 8 | completed |") and "| 4.0000 | 14.0000 |" in line for line in md)

    rows_all, mem = gather(sweep)
    assert mem == "peak_allocated_gib"
    assert "no completed point fits" in (write_report(sweep, budget=1.0) / "summary.md").read_text().splitlines()[0]


def test_budget_parsing_and_sweep_file_errors(tmp_path, monkeypatch):
    # one size parser for make plan, make report and the recipe: IEC units are binary, SI units decimal
    assert parse_size("40GiB", "BUDGET") == 40 << 30 and parse_size("512MiB", "BUDGET") == 1 << 29
    assert parse_size("3", "BUDGET") == 3 << 30 and parse_size("40GB", "BUDGET") == 40 * 10 ** 9
    assert parse_size("1.5TB", "BUDGET") == 1.5e12 and parse_size("2Ti", "BUDGET") == 2 << 40
    for bad in ("lots", "-1GB", "0", "12XB", "nan"):
        with pytest.raises(UserError, match=f"^BUDGET: '{bad}'"):
            parse_size(bad, "BUDGET")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"s.yaml: grid.train.micro_bach_size: unknown recipe key .*did you mean"):
        load_sweep(_sweep_file(tmp_path, {"train.micro_bach_size": [4]}))
    with pytest.raises(UserError, match="s.yaml: unknown key 'grdi'"):
        (tmp_path / "s.yaml").write_text("grid: {train.max_steps: [1]}\ngrdi: {}\n")
        load_sweep(tmp_path / "s.yaml")


def test_report_of_a_sweep_that_never_ran_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _sweep_file(tmp_path, {"train.micro_batch_size": [2, 4]})
    proc = subprocess.run([sys.executable, "-m", "memtrain", "report", str(path)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, [
        f"memtrain: error: {path}: no point of sweep 's' has run (runs/s holds none of its 2 points); run them first: "
        f"make sweep SWEEP={path}"]), proc.stderr
    assert not (tmp_path / "reports").exists()


def test_point_ids_args_and_resumability(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(_sweep_file(tmp_path, {"activation_checkpointing": [{"policy": "every:2"}, {"policy": "none"}],
                                              "deepspeed": [DS]}, set_={"train.max_steps": 3}))
    p = sweep.points[0]
    assert p.id == "policy=every-2,deepspeed=zero3_ckpt"
    assert load_sweep(sweep.path).points[0].id == p.id  # stable across invocations
    assert train_args(sweep, p) == ["--deepspeed", DS, "--set", "train.max_steps=3",
                                    "--set", "activation_checkpointing.policy=every:2", "--run-dir", str(p.run_dir)]
    assert not is_finished(sweep, p)
    prepare_point(sweep, p)
    (p.run_dir / "stderr.log").write_text("Traceback...\n  File \"x.py\"\nRuntimeError: CUDA out of memory. Tried\n")
    assert record_outcome(p, 1)["status"] == "oom"
    assert is_finished(sweep, p)
    changed = load_sweep(_sweep_file(tmp_path, {"activation_checkpointing": [{"policy": "every:2"}],
                                                "deepspeed": [DS]}, set_={"train.max_steps": 4}))
    assert not is_finished(changed, changed.points[0])  # a different command: not the same result

    # A preempted point resumes from its checkpoint, under the same command only.
    (p.run_dir / "summary.json").write_text(json.dumps({"status": "preempted"}))
    (p.run_dir / "checkpoints").mkdir()
    (p.run_dir / "checkpoints" / "latest").write_text("step00000002")
    assert not is_finished(sweep, p)
    assert prepare_point(sweep, p)[-1] == "--resume" and not (p.run_dir / "summary.json").exists()
    (p.run_dir / "summary.json").write_text(json.dumps({"status": "preempted"}))
    assert "--resume" not in prepare_point(changed, changed.points[0])
    assert not (p.run_dir / "checkpoints").exists()  # started again from scratch


def test_failure_reason_picks_the_telling_line():
    tqdm = "tiny:  25%|██  | 1/4 [00:01<00:03]\r"
    assert failure_reason(tqdm + "memtrain: error: train.lr: bad\n" + tqdm) == "train.lr: bad"
    tb = "Traceback (most recent call last):\n  File \"a.py\", line 1\n    x()\nValueError: nope\n"
    assert failure_reason(tb + "[2026-01-01 00:00:00,000] [INFO] [launch.py:1:main] Killing\n") == "ValueError: nope"
    assert failure_reason("", "[x] [ERROR] [launch.py:259] exits with return code = -9") .endswith("code = -9")


def test_two_point_sweep_end_to_end_with_one_failure(tmp_path):
    """Real launcher (make train's: memtrain.train.launch), 2 CPU ranks per point; the second point's policy is
    rejected by the trainer."""
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

    rep = run("memtrain.tools.report", str(path), "--budget", "1GiB")
    assert rep.returncode == 0, rep.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "reports/e2e/summary.csv")))
    assert [(r["policy"], r["status"]) for r in rows] == [("full", "completed"), ("bogus", "failed")]
    ok, bad = rows
    assert float(ok["tokens_per_s"]) > 0 and float(ok["activation_gib"]) > 0 and ok["pareto"] == "True"
    assert ok["steps"] == "4" and float(ok["final_loss"]) > 0
    assert bad["reason"] == failed["reason"] and bad["tokens_per_s"] == ""
    md = (tmp_path / "reports/e2e/summary.md").read_text()
    assert "`policy=full`" in md.splitlines()[0] and "| bogus | failed |" in md


def test_shipped_sweep_files_expand(monkeypatch):
    monkeypatch.chdir(ROOT)
    cpu = load_sweep("recipes/sweeps/tiny-cpu.yaml")
    assert len(cpu.points) == 6 and cpu.spec.launcher.gpus_per_run == 2
    from memtrain.config.recipe import ACSection

    if "memory_budget" not in ACSection.model_fields:
        pytest.skip("llama-1b-gpu.yaml's `policy: auto` point needs activation_checkpointing.memory_budget (planner)")
    gpu = load_sweep("recipes/sweeps/llama-1b-gpu.yaml")
    assert len(gpu.points) == 9 * 4 and gpu.spec.launcher.gpus_per_run == 1
    assert {p.values["train.micro_batch_size"] for p in gpu.points} == {4, 8, 16, 32}


def _tree_digest(directory):
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_sweep_never_deletes_a_finished_run(tmp_path, monkeypatch):
    """An empty grid is one line (its one point would be the sweep directory itself); a finished point whose
    command changed is kept as it is; FORCE moves it aside (a rename) before running it again."""
    from memtrain.tools.sweep import points_to_run
    from memtrain.tools.sweep_points import SET_ASIDE

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"s.yaml: grid: needs at least one key with values"):
        load_sweep(_sweep_file(tmp_path, {}))
    sweep = load_sweep(_sweep_file(tmp_path, {"train.max_steps": [3]}))
    p = sweep.points[0]
    assert p.run_dir.parent == sweep.runs_dir and p.run_dir != sweep.runs_dir
    prepare_point(sweep, p)
    for name in ("tb/events.out.tfevents.1", "checkpoints/step00000003/mp_rank_00_model_states.pt", "final/config.json"):
        (p.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (p.run_dir / name).write_text(name)
    (p.run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
    finished = _tree_digest(p.run_dir)
    assert points_to_run(sweep, force=False) == ([], [])

    changed = load_sweep(_sweep_file(tmp_path, {"train.max_steps": [3]}, set_={"train.lr": 0.001}))
    todo, kept = points_to_run(changed, force=False)
    assert todo == [] and [k.id for k in kept] == [p.id]  # not run again, not touched
    assert _tree_digest(p.run_dir) == finished

    todo, kept = points_to_run(changed, force=True)
    assert [t.id for t in todo] == [p.id] and kept == []
    prepare_point(changed, todo[0])
    aside = list((sweep.runs_dir / SET_ASIDE).iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(p.id) and _tree_digest(aside[0]) == finished
    assert sorted(x.name for x in p.run_dir.iterdir()) == ["point.json"]  # the new run starts clean


def test_slurm_sweeps_on_gpu_nodes_ask_for_their_cpu_share():
    """`sinfo -h -o '%c %G'` per node type: each GPU gets the smallest node type's CPUs per GPU (a point with 8 ranks
    on 128-core 8-GPU nodes asks for 128 CPUs, not the partition's default of 1); CPU-only clusters: 0."""
    from memtrain.tools.slurm import cpus_per_gpu

    assert cpus_per_gpu("128 gpu:h100:8(S:0-1)\n") == 16
    assert cpus_per_gpu("128 gpu:h100:8(S:0-1)\n96 gpu:a100:8\n2 (null)\n") == 12  # CPU-only nodes do not count
    assert cpus_per_gpu("64 gpu:4,shard:8\n") == 16 and cpus_per_gpu("4 gpu:8\n") == 1
    assert cpus_per_gpu("2 (null)\n") == 0 and cpus_per_gpu("") == 0


def test_a_sweep_shrinks_from_the_command_line(tmp_path, monkeypatch):
    """--set for every point and --grid for a key's values: fewer points and steps without writing a sweep file; the
    overridden sweep is its own (runs/<name>-<hash>/), and a key that is not in the grid is one line."""
    monkeypatch.chdir(tmp_path)
    path = _sweep_file(tmp_path, {"train.micro_batch_size": [2, 4, 8], "activation_checkpointing.policy": ["none", "full"]})
    whole = load_sweep(path)
    small = load_sweep(path, ["train.max_steps=3"], ["train.micro_batch_size=4"])
    assert len(whole.points) == 6 and [p.values for p in small.points] == [
        {"train.micro_batch_size": 4, "activation_checkpointing.policy": "none"},
        {"train.micro_batch_size": 4, "activation_checkpointing.policy": "full"}]
    assert small.spec.set["train.max_steps"] == 3 and "--set" in " ".join(train_args(small, small.points[0]))
    assert "train.max_steps=3" in train_args(small, small.points[0])
    assert small.name.startswith("s-") and small.name != whole.name and small.runs_dir != whole.runs_dir
    assert load_sweep(path, ["train.max_steps=3"], ["train.micro_batch_size=4"]).name == small.name  # report finds it
    with pytest.raises(UserError, match=r"^--grid train.lr: not a grid key of .*s.yaml \(its keys: "
                                        r"activation_checkpointing.policy, train.micro_batch_size\)"):
        load_sweep(path, [], ["train.lr=1,2"])
    with pytest.raises(UserError, match=r"s.yaml: set: unknown recipe key 'train.max_step'; did you mean 'max_steps'"):
        load_sweep(path, ["train.max_step=3"])


def test_throughput_plot_starts_at_zero_and_says_the_spread(tmp_path, monkeypatch):
    """Points 3 % apart (noise, here) are drawn from zero, not on an axis zoomed onto them; the title gives the
    spread. The figure is read as it is saved."""
    from matplotlib.figure import Figure

    saved = {}
    real_savefig = Figure.savefig

    def keep(fig, path, *a, **k):
        saved[path.name] = [(ax.get_xlim(), ax.get_ylim(), ax.get_title()) for ax in fig.axes]
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(_sweep_file(tmp_path, {"activation_checkpointing.policy": ["none", "full", "op"]}))
    for p, (m, t) in zip(sweep.points, [(2.00, 1000.0), (1.96, 1030.0), (2.04, 1015.0)]):
        _write_events(p.run_dir / "tb", memory=m, tokens_per_s=t)
        _summary(p.run_dir, "completed")
    write_report(sweep, budget=None)
    (xlim, ylim, title), = saved["throughput_vs_memory.png"]
    assert xlim[0] == 0 and ylim[0] == 0 and ylim[1] > 1035 and xlim[1] > 3.29, (xlim, ylim)
    assert title.endswith(f"tokens/s {1035 / 1005:.2f}×, memory {3.29 / 3.21:.2f}×"), title  # medians: t + 5, m + 1.25

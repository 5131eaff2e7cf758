"""`python -m memtrain <command>`: one front door lists and dispatches every tool; each command's --help works."""
import subprocess
import sys

import pytest

from conftest import ROOT, _env
from memtrain.__main__ import COMMANDS, main


def test_front_door_lists_every_command():
    listed = subprocess.run([sys.executable, "-m", "memtrain", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0
    for name in ("train", "preflight", "plan", "explain-config", "ac-profile", "sweep", "report", "bench",
                 "gpu-check", "bench-host", "export", "prepare-data", "bench-data"):
        assert f"\n  {name} " in listed.stdout, listed.stdout
    unknown = subprocess.run([sys.executable, "-m", "memtrain", "trian"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert unknown.returncode == 2 and unknown.stderr.startswith("memtrain: error: unknown command 'trian'")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_has_its_help(command, capsys):
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:  # `train` installs the trainer's stop-signal handlers: give pytest its own back
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
    if command == "gpu-check":  # bench's parser, entered with --gpu-check
        assert "--gpu-check" in out
    if command in ("preflight", "explain-config"):  # their own flag and every flag of train.py they pass on
        assert all(flag in out for flag in ("--world-size", "--deepspeed", "--recipe", "--set", "--run-dir"))


def test_makefile_targets_use_the_front_door():
    makefile = (ROOT / "Makefile").read_text()
    for name in ("preflight", "plan", "explain-config", "ac-profile", "sweep", "report", "bench", "gpu-check",
                 "bench-host", "bench-data"):
        assert f"python -m memtrain {name} " in makefile, name


def test_make_variables_with_spaces_stay_one_argument():
    """`make report BUDGET="40 GB"` (and paths with spaces): each variable reaches the command as one argument."""
    import shlex

    dry = subprocess.run(["make", "-n", "report", "plan", "BUDGET=40 GB", "SWEEP=my sweeps/s.yaml", "DS=my ds.json",
                          "RECIPE=my recipe.yaml"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()  # make -n prints a recipe's continued lines as written
    report, plan = [shlex.split(line) for line in lines if " -m memtrain " in line]
    assert report[report.index("report") + 1] == "my sweeps/s.yaml" and "--budget=40 GB" in report
    assert "--budget=40 GB" in plan and plan[plan.index("--deepspeed") + 1] == "my ds.json"
    assert plan[plan.index("--recipe") + 1] == "my recipe.yaml"


def test_export_mistakes_are_one_line(tmp_path, capsys):
    from memtrain.tools import export

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"recipe": {"name": "tin')  # cut short
    cases = {("--step", "two"): "--step: invalid int value: 'two' (see python -m memtrain export --help)",
             (): f"{run / 'config.json'}: damaged (JSONDecodeError: Unterminated string starting at: line 1 column 21 "
                 "(char 20)): the recipe the run trained with is unknown, so its model cannot be rebuilt; restore "
                 "config.json from a copy"}
    for flags, line in cases.items():
        with pytest.raises(SystemExit) as e:
            export.main([str(run), *flags])
        assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"memtrain: error: {line}"]

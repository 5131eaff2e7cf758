"""`python -m memtrain <command>`: one front door lists and dispatches every tool; each command's --help works."""

import pytest

from conftest import ROOT
from memtrain.__main__ import COMMANDS, main


def _exit_code(argv: list[str]) -> int:
    """`python -m memtrain ARGV` in this process, which it must leave by exiting: its exit code."""
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:  # `train` installs the trainer's stop-signal handlers: give pytest its own back
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return e.value.code


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_has_its_help(command, capsys):
    assert _exit_code([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out
    assert out.startswith(f"usage: python -m memtrain {command} ")
    if command == "gpu-check":  # its own flags, not bench's
        assert "--no-long" in out and "--gpu-check" not in out and "--no-search" not in out
    if command in ("preflight", "explain-config"):  # their own flag and every flag of train.py they pass on
        assert all(flag in out for flag in ("--world-size", "--deepspeed", "--recipe", "--set", "--run-dir"))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_names_itself_in_errors(command, capsys):
    """A bad flag's line points to the --help that the front door prints: the same parser, the same name."""
    assert _exit_code([command, "--no-such-flag"]) == 2
    name = "src/train.py" if command == "train" else f"python -m memtrain {command}"  # train: the launcher's script
    assert capsys.readouterr().err.rstrip().endswith(f"(see {name} --help)")


def test_makefile_targets_use_the_front_door():
    makefile = (ROOT / "Makefile").read_text()
    for name in ("preflight", "plan", "explain-config", "ac-profile", "sweep", "report", "bench", "gpu-check",
                 "bench-host", "bench-plan", "bench-data"):
        assert f"python -m memtrain {name} " in makefile, name


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

"""Several src/train.py runs in one launch (tests/trainer_runs_worker.py): one start-up of the launcher, the
interpreter, torch and DeepSpeed for all of them; each run's own slice of the launch's output."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from launching import ROOT, launch_cmd, run_launch

WORKER = ROOT / "tests" / "trainer_runs_worker.py"
MARK = "=== trainer_runs_worker: run "  # the worker's line before each run (rank 0)


def run_in_one_launch(steps: list, spec: Path, nproc: int = 2, timeout: float = 600,
                      env=None, launcher=None) -> list[subprocess.CompletedProcess]:
    """Run `steps` (the worker's list: {"argv": [...]} runs and {"cut_back": [...]} copies) in one launch with
    nproc ranks (0: plain python, one rank; `launcher`: another launcher's words, as launching.launch_cmd takes);
    one CompletedProcess per run, with that run's stdout and stderr (the launcher's own lines before the first run
    go to the first) and the launch's return code."""
    spec.write_text(json.dumps(steps))
    proc = run_launch(launch_cmd(WORKER, [str(spec)], nproc, launcher), timeout=timeout, env=env)
    runs = sum("argv" in s for s in steps)
    outs, errs = _split(proc.stdout, runs), _split(proc.stderr, runs)
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err) for out, err in zip(outs, errs)]


def _split(text: str, runs: int) -> list[str]:
    """`text` cut at the worker's marks: run i's part runs from its mark to the next; a mark never printed (the
    launch failed before that run) leaves that run the launch's whole output, so a failure shows in every run."""
    parts = []
    for i in range(runs):
        start = text.find(f"{MARK}{i}\n")
        end = text.find(f"{MARK}{i + 1}\n")
        if start < 0:
            parts.append(text)
            continue
        parts.append(text[0 if i == 0 else start:end if end >= 0 else len(text)])
    return parts

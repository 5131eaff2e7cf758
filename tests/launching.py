"""One way for tests to start a launch: a script under DeepSpeed's launcher (or plain python) in a session of its
own, so that a time-out kills every process of it (launcher, launch.py, ranks), not the launcher alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from memtrain.train.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "src" / "train.py"


def _env() -> dict:
    env = dict(os.environ)
    # this checkout first; keep what the caller's PYTHONPATH adds (e.g. wheels unpacked beside the image)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def launch_cmd(script: Path = TRAIN, args: Sequence[str] = (), nproc: int = 2,
               launcher: Optional[Sequence[str]] = None) -> list[str]:
    """The command line of a launch of `script`: nproc 0 is `python script`; otherwise DeepSpeed's launcher with
    nproc CPU ranks (`launcher`: another launcher's words in its place, e.g. python -m memtrain.train.launch)."""
    if not nproc:
        return [sys.executable, str(script), *args]
    head = list(launcher) if launcher else [str(Path(sys.executable).with_name("deepspeed"))]
    return [*head, "--num_gpus", str(nproc), "--master_port", str(free_port()), str(script), *args]


def processes(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in session or process group `sid`, read from /proc (a zombie has
    ended: it only waits to be reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended while listed
            continue
        state, _, pgid, session = stat[stat.rindex(")") + 2:].split()[:4]  # after the command name, which may hold spaces
        if sid in (int(pgid), int(session)) and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


class Launch:
    """A started launch (`.proc`, its Popen, leads a new session and process group). `communicate(timeout)` kills
    the whole group on a time-out and raises TimeoutExpired, as subprocess.run does; leaving a `with` block kills
    whatever of it still runs."""

    def __init__(self, cmd: Sequence[str], cwd: Path = ROOT, env: Optional[dict] = None,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE):
        self.cmd = list(cmd)
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=env or _env(), stdout=stdout, stderr=stderr, text=True,
                                     start_new_session=True)
        self.sid = self.proc.pid

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def communicate(self, timeout: float) -> tuple[str, str]:
        try:
            return self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self, wait_s: float = 10) -> None:
        """SIGKILL the process group and any process of the session that left it; reap the launcher and wait
        (up to wait_s) until none of them runs."""
        deadline = time.time() + wait_s
        while True:
            try:
                os.killpg(self.sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            left = processes(self.sid)
            for pid, _ in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.communicate(timeout=1)  # reaps it and closes its pipes
            except (subprocess.TimeoutExpired, ValueError):
                pass
            if not left or time.time() > deadline:
                return
            time.sleep(0.1)


def run_launch(cmd: Sequence[str], timeout: float = 600, cwd: Path = ROOT,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a launch to its end (output captured); on a time-out every process of it is killed and
    subprocess.TimeoutExpired raised."""
    with Launch(cmd, cwd=cwd, env=env) as launch:
        out, err = launch.communicate(timeout)
    return subprocess.CompletedProcess(launch.cmd, launch.proc.returncode, out, err)

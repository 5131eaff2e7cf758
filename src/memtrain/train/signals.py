"""Stop signals (SIGTERM, SIGINT, SIGUSR1): recorded from the first line of `src/train.py` on,
agreed on by every rank within two steps.

`install()` runs before anything slow (imports of torch and DeepSpeed, validation, the model build),
so a signal during start-up is recorded rather than killing the process with the signal's default
action (or being dropped: under Slurm's launcher the workers inherit SIGUSR1 ignored). The trainer
asks `received()` once before its first step (a start-up stop ends the run as preempted with nothing
saved), and `StopAgreement` once per step after it.

A launcher that ends while its ranks train counts as a stop too (`watch_launchers`): DeepSpeed's `deepspeed` runner
forwards no signal to the `launch.py` below it, so a SIGTERM to the runner alone (`timeout`, Kubernetes, a CI
runner, `kill <pid>`) would leave the ranks training on their own.

`StopDeadline` warns once where stopping (up to two steps, then a save) would outlast train.stop_deadline_s.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional
import select
import time

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_received: list[str] = []


def _handler(signum, frame) -> None:
    if not _received:
        _received.append(signal.Signals(signum).name)


def install() -> None:
    """Record the first stop signal instead of dying of it, and watch the launchers above this rank (idempotent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
    watch_launchers()


# What starts ranks and can end without taking them along: DeepSpeed's runner (`deepspeed`) and its `launch.py`,
# torchrun's agent, and `make train` above them. A shell or `nohup` is none of these: a run outlives the
# terminal it was started from, as before.
_LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "memtrain.train.launch",
                     "torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_PROGRAMS = ("deepspeed", "torchrun", "make", "gmake")
_watching: list = []


def launcher_name(cmdline: list[str]) -> Optional[str]:
    """The launcher `cmdline` (a process's argv) runs, directly or as a Python script or module; None for others."""
    if not cmdline:
        return None
    program = os.path.basename(cmdline[0])
    if program in _LAUNCHER_PROGRAMS:
        return program
    if not program.startswith("python"):
        return None
    args = iter(cmdline[1:])
    for arg in args:
        if arg == "-m":
            module = next(args, "")
            return module if module in _LAUNCHER_MODULES else None
        if arg == "-c":  # a command, no script
            return None
        if arg in ("-W", "-X"):  # flags with a value
            next(args, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg) if os.path.basename(arg) in _LAUNCHER_PROGRAMS else None
    return None


def launchers() -> list[tuple]:
    """(psutil.Process, its launcher's name) for each launcher above this process, parent first, up to the first
    process that is none."""
    chain = []
    try:
        proc = psutil.Process().parent()
        while proc is not None and proc.pid > 1 and (name := launcher_name(proc.cmdline())):
            chain.append((proc, name))
            proc = proc.parent()
    except psutil.Error:  # one ended already, or is not ours to read: watch what was found
        pass
    return chain


def watch_launchers() -> None:
    """A daemon thread that records a stop (as SIGTERM) the moment a launcher above this rank ends, so every rank
    saves and exits within two steps, and no rank outlives its launcher. It blocks on the launchers' pidfds (Linux
    5.3+: no polling; a launcher that ended but is not yet reaped counts as ended), else looks once a second."""
    if _watching:
        return
    chain = launchers()
    _watching.append(chain)
    if chain:
        threading.Thread(target=_watch, args=(chain,), name="memtrain-launcher-watch", daemon=True).start()


def _watch(chain: list[tuple]) -> None:
    proc, name = _wait_for_first_end(chain)
    if not _received:
        _received.append(signal.SIGTERM.name)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"memtrain: {name} (pid {proc.pid}), which launched this rank, has ended: stopping as on SIGTERM "
              "(every rank saves and exits)", file=sys.stderr, flush=True)


def _wait_for_first_end(chain: list[tuple]) -> tuple:
    try:
        fds = {os.pidfd_open(proc.pid): (proc, name) for proc, name in chain}
    except (AttributeError, OSError):
        fds = {}
    if fds and all(proc.is_running() for proc, _ in chain):  # each pidfd is the process found, not a reused pid
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        return fds[poller.poll()[0][0]]
    while True:
        for proc, name in chain:
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    return proc, name
            except psutil.Error:
                return proc, name
        time.sleep(1.0)


def received() -> Optional[str]:
    """The first stop signal this process got, by name, or None."""
    return _received[0] if _received else None


def one_hot() -> list[float]:
    return [float(received() == sig.name) for sig in STOP_SIGNALS]


def names(flags) -> list[str]:
    """The signals an all-reduced `one_hot` says some rank got."""
    return [sig.name for sig, n in zip(STOP_SIGNALS, flags) if n > 0]


class StopAgreement:
    """Every rank learns of a stop signal on any rank within two steps, at the same step, with no host-device
    sync: after each step an asynchronous all-reduce of this rank's flags starts on a gloo group (host memory,
    also under NCCL), and the next step's call waits for it (long since done: a whole step ran meanwhile).
    The same all-reduce carries rank 0's "a timed save is due" (`save_every_s` since the last save, by its clock):
    the ranks' clocks differ, so rank 0 decides and every rank saves at the same step."""

    def __init__(self, world: int, save_every_s: Optional[float] = None, rank: int = 0) -> None:
        import torch.distributed as dist  # noqa: PLC0415 torch: heavy, imported only when this runs

        # every rank creates the group, at the same point of its start-up
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        self.pending = None
        self.save_every_s, self.rank = save_every_s, rank
        self.last_save = time.monotonic()
        self.save_due = False  # agreed: every rank saves at this step's boundary

    def saved(self) -> None:
        """A model checkpoint was saved: the timed save's clock starts again."""
        self.last_save = time.monotonic()

    def _due_here(self) -> float:
        return float(self.rank == 0 and self.save_every_s is not None
                     and time.monotonic() - self.last_save >= self.save_every_s)

    def step(self) -> list[str]:
        """After a step: the signals that some rank had received by the end of the previous step (and, in
        `save_due`, whether rank 0 had found a timed save due by then)."""
        import torch  # noqa: PLC0415 torch: heavy, imported only when this runs
        import torch.distributed as dist  # noqa: PLC0415 torch: heavy, imported only when this runs

        if self.group is None:
            self.save_due = bool(self._due_here())
            if self.save_due:
                self.saved()
            return [received()] if received() else []
        decided, self.save_due = [], False
        if self.pending is not None:
            work, flags = self.pending
            work.wait()
            values = flags.tolist()
            decided, self.save_due = names(values[:-1]), values[-1] > 0
        if self.save_due:  # agreed: rank 0's clock starts again now, so its next flag asks for the next save only
            self.saved()
        flags = torch.tensor(one_hot() + [self._due_here()])
        self.pending = (dist.all_reduce(flags, group=self.group, async_op=True), flags)
        return decided

    def close(self) -> None:
        """Wait for the all-reduce in flight (every rank started it) before the process group goes."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None


class StopDeadline:
    """train.stop_deadline_s: warn (once, rank 0) when a stop, up to 2 steps and then a save, would outlast it.
    Step time is measured after the metric warm-up; save time once a save ran (until then it is left out)."""

    def __init__(self, deadline_s: Optional[float], warmup_steps: int) -> None:
        self.deadline_s, self.warmup_steps = deadline_s, warmup_steps
        self.intervals = 0
        self.warned = False

    def check(self, step_s: float, save_s: Optional[float], rank: int) -> None:
        self.intervals += 1
        if self.deadline_s is None or self.warned or rank != 0 or self.intervals == 1 and self.warmup_steps:
            return  # the first interval holds the warm-up steps
        needed = 2 * step_s + (save_s or 0.0)
        if needed > self.deadline_s:
            self.warned = True
            save = f" and a save ({save_s:.1f} s)" if save_s else " (a save not yet measured)"
            print(f"warning: a stop signal may arrive {self.deadline_s:g} s before the job is killed "
                  f"(train.stop_deadline_s), but stopping takes up to 2 steps (2 x {step_s:.1f} s){save} = "
                  f"{needed:.0f} s: ask Slurm for a longer warning (sbatch --signal=B:USR1@SECONDS, and "
                  "MEMTRAIN_SIGNAL_LEAD_S for slurm/train.sbatch) or save more often", flush=True)

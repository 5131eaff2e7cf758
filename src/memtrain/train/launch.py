"""`make train`'s launcher: DeepSpeed's `deepspeed` runner, run unchanged in this process, with a stop signal passed on
to the ranks and their clean stop waited for (`python -m memtrain.train.launch <deepspeed's flags> src/train.py ...`).
On a machine without a GPU, make train's own line starts the ranks here instead (memtrain.train.local_launch).

DeepSpeed's runner sets no signal handler on one node: Ctrl-C ended it with a KeyboardInterrupt traceback while the
ranks below it were still saving, and a SIGTERM to it alone reached no rank (they notice its end instead:
memtrain.train.signals). Here a SIGINT or SIGTERM is recorded, sent on to every rank (each records the first stop
signal it gets, so a Ctrl-C that reached them already changes nothing), and this process waits for the ranks to save
and exit, then exits 128 + the signal's number, without a traceback. DeepSpeed's `launch.py` between them is left
alone: a second signal to it would cut its own clean-up short. DeepSpeed's accelerator is named here, once, for the
launcher and the ranks (memtrain.errors.name_cpu_accelerator), instead of by a separate Python process that
imported torch only to ask.
"""
from __future__ import annotations

import signal
import sys
from typing import Optional

import psutil

from memtrain.quick_exit import quick_exit
from memtrain.errors import name_cpu_accelerator
from memtrain.train import local_launch

STOPS = (signal.SIGINT, signal.SIGTERM)


def main(argv: Optional[list[str]] = None) -> None:
    stopped: list[int] = []

    def pass_on(signum, frame) -> None:
        stopped.append(signum)
        for rank in _ranks():
            try:
                rank.send_signal(signum)
            except psutil.Error:  # it has ended already
                pass

    for sig in STOPS:  # first: a stop during the imports below ends this launch before it starts any rank
        signal.signal(sig, pass_on)

    local = local_launch.parse(sys.argv[1:] if argv is None else argv)
    if local is not None and local_launch.applies():  # CPU ranks on this machine: started here, no torch imported
        if stopped:
            sys.exit(128 + stopped[0])
        code = local_launch.wait(local_launch.start(local))
        quick_exit(128 + stopped[0] if stopped else code)

    name_cpu_accelerator()
    from deepspeed.launcher.runner import main as run  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    if stopped:
        sys.exit(128 + stopped[0])
    try:
        run(argv)
    except SystemExit:  # launch.py's exit code, passed on by the runner (1 after a signal reached it)
        if not stopped:
            raise
    quick_exit(128 + stopped[0] if stopped else 0)  # the ranks have ended: no seconds of module teardown here


def _ranks() -> list:
    """The ranks (and what they started): below DeepSpeed's launch.py, which is left alone, or this process's own."""
    procs = []
    for child in psutil.Process().children():
        try:
            below_launch = "deepspeed.launcher.launch" in child.cmdline()
        except psutil.Error:  # it has ended already
            continue
        procs += child.children(recursive=True) if below_launch else [child, *child.children(recursive=True)]
    return procs


if __name__ == "__main__":
    main()

"""End a process whose command has finished, without the interpreter's teardown of torch, transformers and
DeepSpeed: their thousands of modules are garbage-collected one by one at exit, which took 4 s of a one-process
`src/train.py` run and 10 s of two ranks side by side on this 2-core machine (2026-11-26), after the run's last line.

What a normal exit does first still happens, in the same order: `threading._shutdown` (the threading module's exit
hooks, which end idle thread pools such as the one torch.compile's first compile leaves, then a join of every
thread that is not a daemon), every `atexit` handler (torch's compile workers, logging's files), a flush of stdout
and stderr. Only the modules' own teardown is skipped, which writes nothing."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int = 0) -> NoReturn:
    # CPython's own, what Py_Finalize runs first: joining the threads alone waited forever on a thread pool's idle
    # workers, which only the threading module's exit hooks end
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # CPython's own: what Py_Finalize runs next
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

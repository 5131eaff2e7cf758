"""The tests' one launch helper (tests/launching.py): a time-out ends every process of a launch."""
import os
import subprocess
import time

import psutil
import pytest

from conftest import Launch, launch_cmd


def _of_session(sid: int) -> list[psutil.Process]:
    """Every live process whose session or process group is `sid` (psutil and os, not the helper's /proc listing)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and sid in (os.getsid(p.pid), os.getpgid(p.pid)):
                found.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return found


def test_a_launch_that_times_out_leaves_no_process(tmp_path):
    """DeepSpeed's launcher with 2 ranks that only sleep: once both ranks run, a 1-second time-out raises
    TimeoutExpired and leaves no process of the launch (runner, launch.py, ranks) alive."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    launch = Launch(launch_cmd(sleeper, nproc=2))
    try:
        deadline = time.time() + 300
        while True:
            ranks = [p for p in _of_session(launch.sid) if "--local_rank=" in " ".join(p.cmdline())]
            if len(ranks) == 2:
                break
            assert launch.proc.poll() is None and time.time() < deadline, launch.proc.communicate()
            time.sleep(0.2)
        assert len(_of_session(launch.sid)) >= 4  # the runner, launch.py and the two ranks
        started = time.time()
        with pytest.raises(subprocess.TimeoutExpired):
            launch.communicate(timeout=1)
        assert time.time() - started < 15
        assert _of_session(launch.sid) == []
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    finally:
        for p in _of_session(launch.sid):
            p.kill()

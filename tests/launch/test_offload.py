"""memtrain's offload of checkpointed activations (cpu_checkpointing), on CPU.

In-process tests run the real scheduling code (slots, prefetch, pool) with two copy engines:
the CPU one the trainer uses (plain copies), and `DeferredCopies`, which behaves like CUDA's
side stream (copies run later, in order, only once waited for), so a missing wait or a buffer
recycled too early shows up as wrong numbers. The real ZeRO-3 path is checked on a launch of
tests/launch/test_ac_policies.py (its sqrt run: the same default JSON, DeepSpeed's reentrant checkpoint).
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from conftest import ROOT, sitecustomize_env


# --------------------------------------------------------------------------- the benchmark's pieces

def test_bench_runs_the_trainer_with_offload(tmp_path):
    """A bench set-up is the trainer itself (src/train.py) with bench settings: random tokens, no
    model checkpoint, figures from its summary.json; the plain baseline is its own process."""
    from memtrain.tools.bench.runner import Runner

    run = Runner(None, ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=2"],
                 str(ROOT / "ds_configs" / "zero3_ckpt.json"), steps=2, warmup=1, ngpus=1)
    result = run("memtrain:full+offload@torch")
    assert "error" not in result, result
    assert result["tokens_per_s"] > 0 and result["peak_gib"] is None  # CPU: no GPU peak
    assert result["plan"] == "RR" and result["world_size"] == 1
    assert result["offloaded_gib"] == 0  # a CPU run's activations are already in host memory: nothing to copy
    assert not list(run.tmp.glob("*/checkpoints"))  # bench settings: no model checkpoint written
    plain = run("torch:noac")
    assert "error" not in plain and plain["tokens_per_s"] > 0 and plain["world_size"] == 1


HANG = """import os, subprocess, sys, time
if os.environ.get("HANG_PID_FILE") and "-m" in sys.orig_argv and "memtrain.tools.bench.plain" in sys.orig_argv:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = os.environ["HANG_PID_FILE"]
    open(path + ".tmp", "w").write(str(child.pid))
    os.replace(path + ".tmp", path)  # whole, or not there
    time.sleep(600)
"""


def _child_pid(path: Path, limit_s: float = 60) -> int:
    deadline = time.time() + limit_s
    while not path.exists():
        assert time.time() < deadline, "the hung set-up never started its child"
        time.sleep(0.1)
    return int(path.read_text())


def _gone(pid: int, limit_s: float = 10) -> bool:
    deadline = time.time() + limit_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:  # not left behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    return not alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"  # a zombie is dead (its parent was killed and init has not reaped it yet)


def test_a_hung_set_up_is_killed_with_its_children_after_the_timeout(tmp_path, monkeypatch):
    """One set-up that hangs (here before it starts, in a sitecustomize) costs --setup-timeout, not the rest of the
    run: its process and the processes it started (a launcher's ranks, compile workers) are killed, and the
    result says so."""
    from memtrain.tools.bench.runner import Runner

    env = sitecustomize_env(tmp_path / "hooks", HANG)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("HANG_PID_FILE", str(tmp_path / "child.pid"))
    run = Runner(None, [], "ds_configs/zero3_ckpt.json", 1, 0, 1, timeout_s=10)
    result = run("torch:noac")
    assert result["error"] == "timed out after 10 s (killed)" and result["wall_s"] < 60
    assert _gone(_child_pid(tmp_path / "child.pid", limit_s=0))  # written within the 10 s, before the kill


def _bench_running_a_hung_set_up(tmp_path):
    """A bench process (Runner) whose plain-PyTorch set-up hangs: the bench's Popen and the set-up's child's pid."""
    env = sitecustomize_env(tmp_path / "hooks", HANG)
    env["HANG_PID_FILE"] = str(tmp_path / "child.pid")
    script = "from memtrain.tools.bench.runner import Runner; Runner(None, [], 'ds_configs/zero3_ckpt.json', 1, 0, 1)('torch:noac')"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, _child_pid(tmp_path / "child.pid")


def test_sigterm_to_the_bench_kills_the_set_up_it_is_running(tmp_path):
    """`timeout 540 python -m memtrain.tools.bench ...` signals the bench only; the set-up runs in its own session,
    so the bench kills it on the way out instead of leaving it on the GPU."""
    proc, child = _bench_running_a_hung_set_up(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _gone(child)


def test_a_killed_bench_takes_its_set_up_along(tmp_path):
    """A bench killed without a word (SIGKILL: the OOM killer, `kill -9`) cannot kill its set-up, which runs in a
    session of its own; the kernel kills the set-up's own process (PR_SET_PDEATHSIG), not what that one started."""
    import psutil

    proc, child = _bench_running_a_hung_set_up(tmp_path)
    setup = psutil.Process(child).ppid()
    assert setup != proc.pid and psutil.Process(setup).ppid() == proc.pid
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(setup)
    _gone(child, limit_s=0)  # the set-up's own child is the kernel's to reparent: cleaned up here


def test_bench_host_counts_zero3_work_beside_plain_pytorch(tmp_path):
    """make bench-host: the trainer with train.probe and the plain peer in one run, each pinned to one core;
    the report carries the counters (no fetch inside memtrain's recompute) and the plot."""
    from memtrain.tools.bench.host import run

    results = run(["torch:noac", "memtrain:full", "memtrain:full-leaf-resident"], steps=2, warmup=3, cores=1,
                  out=tmp_path, repeats=1)
    plain, full, hooked = results
    assert plain["probe"]["aten_ops"] > 0 and plain["probe"]["cpu_s"] > 0
    assert full["probe"]["fetches"] == {"forward": 10, "recompute": 0, "backward": 9}  # tiny Llama: 4 leaf layers
    assert hooked["probe"]["fetches"]["recompute"] == 48  # 12 hooked submodules per layer fetch again
    assert full["probe"]["aten_ops"] > 0
    report = (tmp_path / "host_overhead.md").read_text()
    assert "| memtrain:full | trainer, policy 'full' |" in report and "10 / 0 / 9" in report
    assert "ZeRO-3 fetches inside the recompute, memtrain:full: 0 (target 0) - met" in report
    assert (tmp_path / "host_overhead.png").stat().st_size > 0

"""One benchmark set-up at one micro-batch, in a fresh process: the trainer (`src/train.py`) or the plain-PyTorch peer."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.tools.bench.setups import ADAPTERS, parse_setup
from memtrain.train.ports import free_port
from memtrain.train.run_dir import RunDir

TRAIN_PY = Path(__file__).resolve().parents[3] / "train.py"
TIMED_OUT = "timed out"  # a set-up killed after its time limit: its error starts with this
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Runner:
    """Runs one set-up at one micro-batch in a fresh process and returns its measurements."""

    def __init__(self, recipe: Optional[str], overrides: list[str], ds_path: str, steps: int, warmup: int,
                 ngpus: int, cpus: Optional[set[int]] = None, timeout_s: Optional[float] = None):
        self.recipe, self.overrides, self.ds_path = recipe, overrides, ds_path
        self.timeout_s = timeout_s  # one process's wall-clock limit: a hung set-up costs this, not the rest's time
        self.cpus = cpus  # pin each process to these cores (memtrain.tools.bench.host)
        self.micro_batch = load_recipe(recipe, overrides).train.micro_batch_size
        self.steps, self.warmup, self.ngpus = steps, warmup, ngpus
        self.tmp = Path(tempfile.mkdtemp(prefix="memtrain-bench-"))
        self.calls = 0
        self.logs: dict[str, str] = {}  # set-up -> its last process's command and output
        src = str(TRAIN_PY.parent)  # subprocesses import memtrain from this checkout
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
                    "PYTHONWARNINGS": "ignore"}

    def _json_for(self, setup) -> Path:
        """The bench JSON with the set-up's cpu_checkpointing (and, for `-leaf`/`-resident`, the JSON keys that
        turn memtrain's ZeRO-3 leaf layers and residency off); the rest as the user wrote it."""
        cfg = load_ds_config(self.ds_path)
        cfg.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = setup.cpu_checkpointing
        zero = cfg.setdefault("zero_optimization", {})
        if not setup.leaf:
            zero["leaf_module"] = {"classes": []}
        if not setup.resident:
            zero["stage3_param_persistence_threshold"] = 0
        path = self.tmp / f"ds-{'offload' if setup.cpu_checkpointing else 'kept'}-{int(setup.leaf)}{int(setup.resident)}.json"
        path.write_text(json.dumps(cfg, indent=2))
        return path

    def __call__(self, name: str, micro_batch: Optional[int] = None, steps: Optional[int] = None,
                 warmup: Optional[int] = None, extra: tuple[str, ...] = ()) -> dict:
        setup = parse_setup(name)
        self.calls += 1
        steps = steps or self.steps
        warmup = self.warmup if warmup is None else warmup
        overrides = [*self.overrides, *extra] + ([f"train.micro_batch_size={micro_batch}"] if micro_batch else [])
        recipe_args = ["--recipe", self.recipe] if self.recipe else []
        out = self.tmp / f"{self.calls}"
        if setup.trainer:
            overrides += [f"activation_checkpointing.policy={setup.ac}",
                          f"activation_checkpointing.cpu_checkpointing_impl={setup.impl}",
                          f"train.max_steps={warmup + steps}", f"train.metric_warmup_steps={warmup}",
                          f"train.log_every={max(1, steps // 4)}", "data.random_tokens=true",
                          "train.save_checkpoints=false"]
            if setup.backend != "auto":
                overrides.append(f"activation_checkpointing.backend={setup.backend}")
            overrides.append(f"train.compile={str(setup.compiled).lower()}")
            overrides += ADAPTERS[setup.adapters]
            if self.ngpus > 1:
                launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(self.ngpus),
                            "--master_port", str(free_port())]
            else:
                launcher = [sys.executable]
            cmd = [*launcher, str(TRAIN_PY), "--deepspeed", str(self._json_for(setup)), *recipe_args,
                   "--run-dir", str(out)]
        else:
            cmd = [sys.executable, "-m", "memtrain.tools.bench.plain", "--setup", name, *recipe_args,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", str(out) + ".json"]
        for item in overrides:
            cmd += ["--set", item]
        started = time.time()
        pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
        proc = _run(cmd, self.env, pin, self.timeout_s)
        self.logs[name] = f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        result = {"setup": name, "label": setup.label, "micro_batch": micro_batch or self.micro_batch,
                  "wall_s": time.time() - started}
        if setup.trainer:
            result.update(_from_summary(RunDir(out).summary_file))
        elif Path(str(out) + ".json").is_file():
            result.update(json.loads(Path(str(out) + ".json").read_text()))
        if "tokens_per_s" in result or result.get("oom"):
            return result
        if proc.returncode is None:
            result.update(oom=False, error=f"{TIMED_OUT} after {self.timeout_s:g} s (killed)")
            return result
        from memtrain.train.faults import is_oom_text  # noqa: PLC0415 here: faults imports torch, which --help must not wait for

        text = proc.stderr + proc.stdout
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        result.update(oom=is_oom_text(text), error=" / ".join(tail) or f"exit {proc.returncode}")
        return result


def _run(cmd: list[str], env: dict, pin, timeout_s: Optional[float]) -> subprocess.CompletedProcess:
    """The set-up's process in its own session, so that on timeout the whole group (the launcher's ranks, inductor's
    compile workers) is killed; returncode None when it was. A SIGTERM or SIGHUP to this process (`timeout`, Slurm, a
    closed terminal) or Ctrl-C kills the group too: in its own session it would not get the signal. If this process
    dies without a word (SIGKILL), the kernel kills the set-up's own process (PR_SET_PDEATHSIG)."""
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)} if main else {}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=functools.partial(_in_child, pin), start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes: its output is lost
                stdout, stderr = "", ""
            return subprocess.CompletedProcess(cmd, None, stdout, stderr)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


def _in_child(pin) -> None:
    """In the set-up's process before it runs: die with the bench (Linux), then the caller's core pinning."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if pin is not None:
        pin()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _from_summary(path: Path) -> dict:
    """A trainer run's figures, per GPU, from its summary.json."""
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    if summary.get("status") == "oom":
        return {"oom": True}
    if summary.get("status") != "completed":
        return {"error": summary.get("reason") or f"status {summary.get('status')}"}
    m, world = summary["metrics"], summary.get("world_size", 1)
    plan = summary.get("ac_plan") or {}
    return {
        "tokens_per_s": m["throughput/tokens_per_s"] / world,
        "step_s": m.get("time/step_s"),
        "peak_gib": summary.get("peak_allocated_gib"),
        "predicted_peak_gib": summary.get("predicted_peak_gib"),
        "mfu": m.get("throughput/mfu"),
        "hfu": m.get("throughput/hfu"),
        "activation_gib": m.get("memory/activation_gib"),
        "offloaded_gib": m.get("memory/offloaded_activation_gib", 0.0),
        "world_size": world,
        "device": summary.get("device"),
        "plan": "".join({"keep": ".", "full": "R", "attn": "A", "mlp": "M", "op": "O"}.get(x, "?")
                        for x in plan.get("layers", [])),
        "probe": {k: v for k, v in (summary.get("probe") or {}).items() if k != "per_step"},
    }

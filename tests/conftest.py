"""Shared helpers: run the real entrypoint (with or without the deepspeed launcher)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import file_order  # noqa: E402  (longest file first)
from file_order import pytest_collection_modifyitems  # noqa: E402,F401
from memtrain import startup_gc  # noqa: E402
from launching import ROOT, TRAIN, Launch, _env, launch_cmd, processes, run_launch  # noqa: E402,F401


def pytest_configure(config):
    """The test modules' imports (torch, transformers, DeepSpeed) made with the collector held, then frozen out of its
    sight, as a run's start-up is (memtrain.startup_gc): each full collection of a test session otherwise scans those
    objects again (a pytest process of two in-process test_cluster tests: 1.8 of its 5.4 CPU-s in the collector,
    0.7 after; the shared 2-core VM, 2026-11-27). Objects the tests make are collected as usual."""
    startup_gc.hold()
    file_order.pytest_configure(config)


def pytest_collection_finish(session):
    """Imports frozen (above); then the young generation collected every 10,000 allocations, not 700: the fake-tensor
    measurements of the planner's tests make millions of short-lived objects, and each young collection also walks
    what survived the last. On the shared 2-core VM (2026-11-27) tests/unit/memory/test_planner.py took 40.6 user-s
    so against 42.8 and 42.9 (collections 61 against 1,042)."""
    startup_gc.imports_done()
    gc.set_threshold(10_000, 20, 20)


# Small and fast, but the real model/data/engine path.
FAST = ["--set", "data.seq_len=64", "--set", "train.micro_batch_size=4", "--set", "data.max_bytes=400000",
        "--set", "train.log_every=1"]  # one TensorBoard point per step


# make train's launcher: on a machine without a GPU it starts the CPU ranks itself, as DeepSpeed's launch.py does
# (tests/launch/test_local_launch.py), without the runner's and launch.py's imports (about 5 CPU-s a launch). For a
# launch whose claim is about the run, not about DeepSpeed's runner.
MAKE_TRAIN_LAUNCHER = (sys.executable, "-m", "memtrain.train.launch")


def run_train(args: list[str], nproc: int = 0, timeout: int = 600, cwd: Path = ROOT,
              env: Optional[dict] = None, launcher=None) -> subprocess.CompletedProcess:
    """nproc=0: `python src/train.py`; nproc>=1: the real `deepspeed` launcher with nproc CPU ranks (`launcher`:
    another launcher's words, e.g. MAKE_TRAIN_LAUNCHER). On a time-out every process of the launch is killed
    (tests/launching.py)."""
    return run_launch(launch_cmd(TRAIN, args, nproc, launcher), timeout=timeout, cwd=cwd, env=env)


# held-out data for eval tests: the standard library's json package (the default training corpus reads the top level)
EVAL_FILES = sorted(Path(__import__("sysconfig").get_paths()["stdlib"]).glob("json/*.py"))
EVAL_PATHS = f"data.eval_paths=[{EVAL_FILES[0].parent}/*.py]"


def eval_loss_by_hand(final: Path, seq_len: int, rows: int) -> tuple[float, int]:
    """The held-out loss of `final/` computed without memtrain: EVAL_FILES as byte-token documents + EOS (256),
    cut into rows of seq_len, the first `rows` of them; their next-token cross-entropy from transformers' own
    forward in float64, averaged over every labelled position. (mean, positions)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    texts = [f.read_text() for f in EVAL_FILES]
    stream = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int64), 256)
                             for t in texts if t.strip()])
    ids = torch.from_numpy(stream[: len(stream) // seq_len * seq_len].reshape(-1, seq_len)[:rows])
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(ids).logits
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                               reduction="none")
    return losses.mean().item(), losses.numel()


def _workers(launcher: subprocess.Popen) -> dict:
    """The launcher's training processes by local rank."""
    import psutil

    out = {}
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        rank = next((c.split("=")[1] for c in cmd if c.startswith("--local_rank=")), None)
        if str(TRAIN) in cmd and rank is not None:
            out[int(rank)] = p
    return out


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def one_thread():
    """In-process parts of launch-tier files on tiny shapes (`pytestmark = pytest.mark.usefixtures("one_thread")`;
    the unit tier runs on one thread throughout, tests/unit/conftest.py): threads only add synchronisation, and
    stall when the cores are shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def ds_config():
    return str(ROOT / "ds_configs" / "zero3_ckpt.json")


def kill_in_save_env(tmp_path: Path, step: int) -> dict:
    """The env of a run that SIGKILLs itself as it renames step `step`'s shards into place: a
    sitecustomize (imported by Python at start-up) wraps os.replace, so no test hook lives in the
    product's save path."""
    from memtrain.train.checkpoint import tag_for

    return sitecustomize_env(tmp_path / "hooks", (
        "import os, signal\n_replace = os.replace\n"
        "def replace(src, dst, *args, **kwargs):\n"
        f"    if os.path.basename(str(src)) == '.tmp-{tag_for(step)}':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _replace(src, dst, *args, **kwargs)\n"
        "os.replace = replace\n"))


def sitecustomize_env(folder: Path, source: str) -> dict:
    """The env of a run that imports `source` as sitecustomize (Python runs it at start-up): a test's fault
    injection lives there, never in the product's code path."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(source)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    return env


def _engine_step_hook_env(tmp_path: Path, name: str, step: int, action: str) -> dict:
    """The env of a run that does `action` (Python lines; `self` is the DeepSpeed engine) right after the optimizer
    step of step `step` (1-based): a sitecustomize wraps DeepSpeed's engine.step once deepspeed is imported, so
    nothing in the product's code path is a test hook."""
    body = "".join(f"                {line}\n" for line in action.splitlines())
    return sitecustomize_env(tmp_path / name, (
        "import builtins, os, signal, sys\n_import = builtins.__import__\n"
        "def _hook(name, *args, **kwargs):\n"
        "    module = _import(name, *args, **kwargs)\n"
        "    engine = getattr(sys.modules.get('deepspeed.runtime.engine'), 'DeepSpeedEngine', None)\n"
        "    if engine is not None and not getattr(engine.step, '_hooked', False):\n"
        "        original = engine.step\n"
        "        def step(self, *a, **k):\n"
        "            out = original(self, *a, **k)\n"
        "            self._hooked_steps = getattr(self, '_hooked_steps', 0) + 1\n"
        f"            if self._hooked_steps == {step}:\n"
        f"{body}"
        "            return out\n"
        "        step._hooked = True\n"
        "        engine.step = step\n"
        "    return module\n"
        "builtins.__import__ = _hook\n"))


def poison_after_step_env(tmp_path: Path, step: int) -> dict:
    """A run whose weights turn NaN in the optimizer step of step `step`, after that step's loss was computed."""
    return _engine_step_hook_env(tmp_path, "poison", step, (
        "p = next(self.module.parameters())\n"
        "local = p.ds_tensor if getattr(p, 'ds_tensor', None) is not None else p.data\n"
        "local.view(-1)[0] = float('nan')"))


def signal_after_step_env(tmp_path: Path, step: int, rank: int, sig: str = "SIGUSR1") -> dict:
    """A run whose rank `rank` receives `sig` right after the optimizer step of step `step`."""
    return _engine_step_hook_env(tmp_path, "signal", step, (
        f"if os.environ.get('RANK', '0') == '{rank}':\n"
        f"    os.kill(os.getpid(), signal.{sig})"))


def all_finite(directory: Path) -> bool:
    """Every floating-point tensor in every .pt file under `directory` is finite (torch.load, not memtrain)."""
    import torch

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    found = False
    for f in directory.rglob("*.pt"):
        for t in tensors(torch.load(f, map_location="cpu", weights_only=False)):
            if t.is_floating_point():
                found = True
                if not torch.isfinite(t).all():
                    return False
    return found


def cut_back(run_dir: Path, dst: Path, step: int) -> Path:
    """A copy of a finished run as if it had stopped after its step-`step` model checkpoint (the same state a run
    stopped there saved): later checkpoints, final/, summary.json and TensorBoard events left out, `latest`
    naming step `step`. Resuming it and comparing with the finished run costs one launch less than a stopped run."""
    import shutil

    from memtrain.train.checkpoint import tag_for

    keep = tag_for(step)
    shutil.copytree(run_dir, dst, ignore=lambda folder, names: [
        n for n in names if (Path(folder) == run_dir and n in ("final", "summary.json", "tb"))
        or (Path(folder).name == "checkpoints" and n.startswith("step") and n > keep)])
    (dst / "checkpoints" / "latest").write_text(keep)
    return dst


def autograd_nodes(loss):
    """Every node of the autograd graph behind `loss`, once each."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack += [f for f, _ in node.next_functions]


def compiled_calls(prof) -> int:
    """Calls into torch.compile'd code that torch.profiler `prof` recorded ('Torch-Compiled Region' events, which
    eager code never makes)."""
    return sum(e.name.startswith("Torch-Compiled Region") for e in prof.events())


SMALL_LLAMA = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def small_llama():
    """A 4-layer Llama of SMALL_LLAMA's shape (vocabulary 257, sequences up to 32), seeded, in train mode."""
    import torch

    from memtrain.config.recipe import ModelSection
    from memtrain.model.build import build_config, build_model

    section = ModelSection(type="llama", config=SMALL_LLAMA)
    torch.manual_seed(0)
    return build_model(section, build_config(section, vocab_size=257, seq_len=32)).train()


def allocator_peak(model, ids, **inputs) -> int:
    """Peak bytes the CPU allocator holds during one forward+backward, above what was held before:
    torch.profiler's memory events (every allocation and free, from the allocator itself), not
    memtrain's tracker. Parameter gradients are dropped as soon as they are accumulated (the
    memory model counts them with the model states). `inputs`: more forward keywords (position_ids)."""
    from torch.profiler import ProfilerActivity, profile

    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()
             if p.requires_grad]
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(input_ids=ids, labels=ids, **inputs).loss
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    return profiled_peak_rise(prof)


def profiled_peak_rise(prof, earlier_frees: bool = False) -> int:
    """The highest net bytes the CPU allocator held above a torch.profiler window's start (its allocation events).

    Only blocks allocated inside the window count, their frees too; `earlier_frees`: frees of blocks made before the
    window count as well (for a caller that adds those blocks' bytes to the start itself). The CPU allocator remembers
    the size of every block made while any profiler was on, so a block from an earlier window (an earlier test's,
    garbage collected now) freed inside this one is reported as a free and would lower the peak by its size: seen as
    1.25 MiB once in about nine unit-tier runs of test_predict_run_of_a_lora_run_matches_the_allocator (2026-11-27)."""
    from torch._C._profiler import _EventType

    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    mine: set[int] = set()
    live = peak = 0
    for _, ptr, size in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            mine.add(ptr)
        elif ptr in mine:
            mine.discard(ptr)
        elif not earlier_frees:
            continue  # made before the window
        live += size
        peak = max(peak, live)
    return peak


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of a chosen size: a tmpfs mounted for the test (needs root, as CI has); `mount(mib)`
    returns its path. Unmounted afterwards."""
    mounted = []

    def mount(mib: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small filesystem needs root")
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Write a file that leaves `leave` bytes free on `disk`."""
    import shutil

    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(free - leave, 0))


@pytest.fixture(autouse=True)
def profiles_measured_afresh():
    """No in-process test reads activation profiles kept on disk: `resolve_run` keeps them under the recipe's
    data.cache_dir for the rest of the process (the repository's .cache/memtrain by default), so a test after one
    that ran the preflight would otherwise read what an earlier run measured, fast here and slow on a fresh clone."""
    from memtrain.memory import profile_cache

    profile_cache.keep_in(None)
    yield
    profile_cache.keep_in(None)

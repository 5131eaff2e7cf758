"""A run directory: its layout (`RunDir`, the one place that names its entries) and its lifecycle: can it be
created, its lock, and `--overwrite` that loses nothing.

`--overwrite` never deletes an earlier run up front. Rank 0 moves the earlier run's entries
(`RUN_ENTRIES`) into `<run-dir>/.overwritten/` (renames: instant, same file system) once every
input has been checked. The earlier run is deleted only when the new run has saved its first model
checkpoint (or, with `train.save_checkpoints: false`, has finished). If the new run fails before
that, the earlier run is moved back and what the new run wrote is removed. A process killed in
between leaves the earlier run in `.overwritten/`, where it can be moved back by hand.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from datetime import datetime
import fcntl
import secrets
import socket

from memtrain.config.saved_run import CONFIG_FILE, CSV_DIR, TENSORBOARD_DIR
from memtrain.errors import NodeError, UserError

SUMMARY_FILE = "summary.json"  # how the run ended: its status, steps, loss and median metrics
CHECKPOINTS = "checkpoints"  # model checkpoints (memtrain.train.checkpoint)
TENSORBOARD = TENSORBOARD_DIR  # DeepSpeed's TensorBoard monitor writes here (its job_name: memtrain.config.ds_config)
FINAL = "final"  # the trained model as transformers loads it (memtrain.train.final)
LOCK = ".lock"  # held (flock) by rank 0 of the run using the directory; not a run entry: never moved aside
# what a run writes (CSV_DIR: DeepSpeed's csv monitor; "deepspeed.log" and "logs": memtrain.train.ds_log)
RUN_ENTRIES = (CONFIG_FILE, SUMMARY_FILE, CHECKPOINTS, TENSORBOARD, CSV_DIR, FINAL, "deepspeed.log", "logs")
ASIDE = ".overwritten"


@dataclass(frozen=True)
class RunDir:
    """One run directory and the paths in it. Made once per run (the trainer, a tool reading a run) and passed down;
    prints as its path, so a message names the directory the user gave."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def final(self) -> Path:
        return self.path / FINAL

    @property
    def config_file(self) -> Path:
        """config.json: the recipe and JSON each segment ran with (memtrain.config.saved_run reads it)."""
        return self.path / CONFIG_FILE

    @property
    def summary_file(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def aside(self) -> Path:
        """Where `--overwrite` keeps the earlier run until this one saved a model checkpoint (`set_aside`)."""
        return self.path / ASIDE

_set_aside: set[Path] = set()  # run dirs this process moved aside (only its own are rolled back)
_locks: dict[Path, int] = {}  # run dirs this process holds: their lock files' descriptors


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, CHECKPOINTS, TENSORBOARD))


def check_creatable(path: Path, what: str) -> None:
    """One line if `path` cannot be a directory: it is a file, sits under one, or is not writable (as this node sees
    it: a NodeError)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise NodeError(f"{what}: '{path}' exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise NodeError(f"{what}: '{path}' is not writable")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise NodeError(f"{what}: '{path}' cannot be created: '{parent}' is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NodeError(f"{what}: '{path}' cannot be created: '{parent}' is not writable")


def set_aside(run_dir: Path) -> None:
    """`--overwrite`, rank 0, after validation: move the earlier run into `<run-dir>/.overwritten/`."""
    aside = run_dir / ASIDE
    if aside.exists():
        # An earlier --overwrite never reached its first model checkpoint: what lies at the top is that
        # failed run, and .overwritten/ still holds the run before it, the one worth keeping.
        for name in RUN_ENTRIES:
            _remove(run_dir / name)
    else:
        aside.mkdir(parents=True)
        for name in RUN_ENTRIES:
            if (run_dir / name).exists():
                os.replace(run_dir / name, aside / name)
    _set_aside.add(run_dir.resolve())


def finish_overwrite(run_dir: Path) -> None:
    """The new run has saved a model checkpoint (or finished): the run it replaces can go."""
    if run_dir.resolve() in _set_aside:
        shutil.rmtree(run_dir / ASIDE, ignore_errors=True)
        _set_aside.discard(run_dir.resolve())


def roll_back(run_dir: Optional[Path]) -> None:
    """The new run failed before `finish_overwrite`: remove what it wrote, put the earlier run back."""
    if run_dir is None or run_dir.resolve() not in _set_aside:
        return
    aside = run_dir / ASIDE
    for name in RUN_ENTRIES:
        _remove(run_dir / name)
        if (aside / name).exists():
            os.replace(aside / name, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)
    _set_aside.discard(run_dir.resolve())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_shared(run_dir: Path, rank: int) -> None:
    """Every rank must see the run directory rank 0 made: memtrain keeps one run directory on storage all nodes
    share (rank 0 renames model checkpoints and writes the status files the batch script reads; every rank writes
    its shards into them). Node-local run directories would each hold a part of every checkpoint, and a resume
    would find none intact: at start-up, each rank looks for a file rank 0 just wrote, and all stop with one line
    naming a node that cannot see it. Three collectives: every rank calls this."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, kept off --help

    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = run_dir / f".shared-check-{token[0]}"
    if rank == 0:
        marker.write_text(token[0])
    dist.barrier()
    try:
        seen = marker.read_text() == token[0]
    except OSError:
        seen = False
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else socket.gethostname())  # every rank has looked by now
    if rank == 0:
        marker.unlink(missing_ok=True)
    missing = sorted({host for host in blind if host is not None})
    if missing:
        raise UserError(f"--run-dir {run_dir}: not shared between the nodes ({', '.join(missing)} cannot see what "
                        "rank 0 wrote there): memtrain keeps a run on storage every node sees; point --run-dir at a "
                        "shared filesystem")


def lock(run_dir: Path) -> tuple[Optional[str], Optional[str]]:
    """Rank 0, before the run writes anything: hold `<run-dir>/.lock` (an exclusive flock, released when the process
    ends, however it ends) so that a second run on the same directory is refused instead of writing the same
    checkpoints and TensorBoard files. Returns (refusal, warning): the line that refuses this run, or a warning where
    the file system has no file locks (Lustre mounted noflock)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if _earlier_attempt(holder):
                return None, (f"--run-dir {run_dir}: its lock is held by this Slurm job's earlier attempt ({holder}), "
                              "left by a lost node (an NFS or Lustre lock outlives its client): going on without it")
            return in_use(run_dir, holder), None
        except OSError as e:
            os.close(fd)
            return None, (f"--run-dir {run_dir}: its file system has no file locks ({e.strerror}): nothing stops a "
                          "second run from using this directory at the same time")
        try:
            if os.stat(run_dir / LOCK).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed the file as it ended (unlock) after this one opened it: open it again
    os.ftruncate(fd, 0)
    job = f" (slurm job {os.environ['SLURM_JOB_ID']})" if os.environ.get("SLURM_JOB_ID") else ""
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {datetime.now():%Y-%m-%d %H:%M:%S}{job}".encode())
    _locks[run_dir.resolve()] = fd
    return None, None


def unlock(run_dir: Optional[Path]) -> None:
    """The run is over: remove the lock file, then release it (`lock` opens again a file removed under it). A process
    that ends otherwise leaves the file, whose flock the kernel released: the next run takes it."""
    fd = _locks.pop(run_dir.resolve(), None) if run_dir is not None else None
    if fd is not None:
        (run_dir / LOCK).unlink(missing_ok=True)
        os.close(fd)


def check_not_in_use(run_dir: Path) -> None:
    """Before any worker starts: one line where another run holds the directory (`lock`)."""
    path = run_dir / LOCK
    if run_dir.resolve() in _locks or not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted: nobody holds it exclusively
    except BlockingIOError:
        if not _earlier_attempt(_holder(fd)):
            raise UserError(in_use(run_dir, _holder(fd))) from None
    except OSError:  # no file locks here: lock() warns in the run
        pass
    finally:
        os.close(fd)


def in_use(run_dir: Path, holder: str) -> str:
    return (f"--run-dir {run_dir}: another run is using it ({holder or 'its holder unknown'}); wait for it to end "
            f"(or stop it), or pass another --run-dir (no run left? a node lost while holding it: remove {run_dir / LOCK})")


def _earlier_attempt(holder: str) -> bool:
    """The holder is this Slurm job itself, from an attempt before its requeue (the requeue keeps the job id, and
    Slurm ended that attempt's processes): its lock stayed behind with a lost node."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and holder.endswith(f"(slurm job {job})")


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""

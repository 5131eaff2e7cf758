"""DeepSpeed's own log off the console: into a file in the run directory (`deepspeed.log`), or
nowhere while validation builds DeepSpeed objects. A clean run's console shows memtrain's plan,
progress bar and summary; DeepSpeed's warnings (e.g. "total_num_steps 3 is less than
warmup_num_steps 4", which memtrain's own validation already covers) stay readable in the file."""
from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path


def _logger() -> logging.Logger:
    from deepspeed.utils import logger  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    return logger


def _console_off(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)
    logger.propagate = False


def buffer() -> None:
    """Off the console now; kept in memory until `to_file` has a place for it. The run directory
    may not be ready yet: `--overwrite` first moves the earlier run's files (its log too) aside."""
    logger = _logger()
    _console_off(logger)
    if not any(isinstance(h, logging.handlers.MemoryHandler) for h in logger.handlers):
        logger.addHandler(logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1))


def log_path(run_dir: Path, rank: int) -> Path:
    """One writer per file: rank 0 writes run_dir/deepspeed.log, rank r run_dir/logs/deepspeed.rank<r>.log
    (appends from many ranks, on several nodes, to one file on a shared file system interleave or clobber)."""
    return Path(run_dir) / ("deepspeed.log" if rank == 0 else f"logs/deepspeed.rank{rank}.log")


def to_file(run_dir: Path, rank: int) -> Path:
    """Send DeepSpeed's logger to this rank's own file (`log_path`), with what `buffer` held first."""
    logger = _logger()
    path = log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(f"[%(asctime)s] [rank {rank}] [%(levelname)s] "
                                           "[%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
    _console_off(logger)
    for h in list(logger.handlers):
        if isinstance(h, logging.handlers.MemoryHandler):
            h.setTarget(handler)
            h.flush()
            logger.removeHandler(h)
    logger.addHandler(handler)
    return path

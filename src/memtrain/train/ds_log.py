"""DeepSpeed's own log off the console: into a file in the run directory (`deepspeed.log`), or
nowhere while validation builds DeepSpeed objects. A clean run's console shows memtrain's plan,
progress bar and summary; DeepSpeed's warnings (e.g. "total_num_steps 3 is less than
warmup_num_steps 4", which memtrain's own validation already covers) stay readable in the file."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path


def _logger() -> logging.Logger:
    from deepspeed.utils import logger

    return logger


@contextmanager
def silenced():
    """No DeepSpeed log while validation constructs DeepSpeed's objects on dummies."""
    logger = _logger()
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def to_file(run_dir: Path, rank: int) -> Path:
    """Send DeepSpeed's logger to run_dir/deepspeed.log (every rank appends, lines say which)."""
    logger = _logger()
    path = Path(run_dir) / "deepspeed.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(f"[%(asctime)s] [rank {rank}] [%(levelname)s] "
                                           "[%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
    for h in list(logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)
    logger.addHandler(handler)
    logger.propagate = False
    return path

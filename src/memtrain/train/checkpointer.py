"""When a run saves a model checkpoint, and only a good one that fits: the step interval and timed saves, the
finite-weights check, the disk space every rank agrees on, the save's duration, and the end of `--overwrite`'s
earlier run once a checkpoint replaces it. How a checkpoint is written and read: memtrain.train.checkpoint."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch
import deepspeed.comm as dist

from memtrain.errors import EXIT_RUN_FAILED, RunFailed, report_here
from memtrain.train import checkpoint
from memtrain.train import run_dir as run_dirs
from memtrain.train.faults import RunPosition, disk_full_message, nonfinite_weights_message, write_failure
from memtrain.train.run_dir import RunDir

SLURM_SAVE_EVERY_MINUTES = 30.0  # a Slurm job's default: a requeue after a lost node loses at most this much


def save_every_s(train) -> Optional[float]:
    """Seconds between timed model checkpoints (train.save_every_minutes; in a Slurm job 30 minutes by default,
    since its requeue resumes from the newest checkpoint); None: no timed saves."""
    minutes = train.save_every_minutes
    if minutes is None and "SLURM_JOB_ID" in os.environ:
        minutes = SLURM_SAVE_EVERY_MINUTES
    return minutes * 60 if minutes and train.save_checkpoints else None


def samples_per_step(train, layout) -> int:
    """Global samples one optimizer step reads (memtrain.model.order)."""
    return train.grad_accum_steps * train.micro_batch_size * layout.dp_size


class Checkpointer:
    """The run's model checkpoints, saved from `engine` into `run_dir.checkpoints`. `shift`: the data's step is the
    step + shift (a resume on another batch size: memtrain.train.reshard), recorded as the samples read."""

    def __init__(self, engine, run_dir: RunDir, train, layout, shift: int = 0) -> None:
        self.engine, self.run_dir, self.train, self.layout, self.shift = engine, run_dir, train, layout, shift
        self.seconds: Optional[float] = None  # how long the last save took (None before the first)

    def due(self, done: int, agreement) -> bool:
        """After step `done` (not the last: the end of the run saves it): every train.save_interval steps, or where
        the ranks agreed that a timed save is due (memtrain.train.signals.StopAgreement)."""
        t = self.train
        return t.save_checkpoints and done < t.max_steps and bool(
            agreement.save_due or (t.save_interval and done % t.save_interval == 0))

    def maybe_save(self, done: int, agreement) -> None:
        """A checkpoint after step `done` where one is due; timed, and the timed saves' clock restarted."""
        if not self.due(done, agreement):
            return
        started = time.monotonic()
        self.save(done)
        self.seconds = time.monotonic() - started
        agreement.saved()

    def save(self, step: int) -> None:
        """A model checkpoint of finite weights only (so "last good checkpoint" always names a usable one), and only
        where it fits: the ranks agree on both before anyone writes, so a full disk is one line, not a torn save. The
        manifest records the samples read, where a resume on another batch size continues. Once saved, an earlier
        run that `--overwrite` set aside goes."""
        engine, run_dir, t, tp = self.engine, self.run_dir, self.train, self.layout.tp
        if not checkpoint.weights_finite(engine):
            raise RunFailed(nonfinite_weights_message(step, t.max_steps, run_dir, t))
        needed, how = checkpoint.space_needed(engine, run_dir.checkpoints, tp)
        free = checkpoint.free_bytes(run_dir.checkpoints)
        short = torch.tensor(float(free < needed), device=engine.device)
        dist.all_reduce(short)  # any rank's filesystem (node-local storage) too small: all stop
        if short.item():
            raise RunFailed(disk_full_message(step, run_dir, needed, how, free))
        try:
            samples = (step + self.shift) * samples_per_step(t, self.layout)
            checkpoint.save(engine, run_dir.checkpoints, step, t.keep_last, tp, samples)
        except (OSError, RuntimeError) as e:  # filled by someone else meanwhile: this rank cannot go on
            if not checkpoint.is_disk_full(e):
                raise
            self._leave_on_full_disk(step, needed, how)
        run_dirs.finish_overwrite(run_dir.path)  # rank 0's: the run this one replaces can go now

    def _leave_on_full_disk(self, step: int, needed: int, how: str) -> None:
        run_dir = self.run_dir
        checkpoint.remove_partial(run_dir.checkpoints, step)
        message = disk_full_message(step, run_dir, needed, how, checkpoint.free_bytes(run_dir.checkpoints))
        if dist.get_world_size() == 1:
            raise RunFailed(message) from None
        # other ranks may wait in a collective of the save: report from this rank and leave (the launcher stops
        # the rest), as an out-of-memory rank does
        write_failure(RunPosition(dist.get_world_size(), dist.get_rank(), run_dir, step), "failed", message)
        report_here(message)
        os._exit(EXIT_RUN_FAILED)

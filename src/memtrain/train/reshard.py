"""Resume on another data-parallel world size: whether it can, the checkpoint converted once to DeepSpeed's universal
format (`<tag>/universal`), and where the data continues (memtrain.model.order.resumed_shift)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memtrain.config.ds_config import offload_device, tp_size, zero_stage
from memtrain.errors import UserError
from memtrain.model.order import resumed_shift
from memtrain.train import checkpoint

RECORD = "converted.json"  # in <tag>/universal: the conversion's worlds and seconds


def check(step_dir: Path, saved_world: int, world: int, recipe, ds_config: dict) -> None:
    """One line where a checkpoint saved by `saved_world` ranks cannot resume on `world` with this recipe and JSON
    (the TP degree and everything in CHECKPOINT_KEYS are the run's: memtrain.config.saved_run), or where the
    samples read so far are not a whole number of this launch's steps."""
    tp, sequence = tp_size(ds_config), recipe.parallel.sequence
    if saved_world != world:
        _check_world(step_dir, saved_world, world, tp, sequence, zero_stage(ds_config))
        if offload_device(ds_config, "optimizer") == "nvme":  # DeepSpeed copies each rank's swap files back
            raise UserError(f"--resume: {step_dir} was saved by {saved_world} ranks, this launch has {world}; "
                            "zero_optimization.offload_optimizer.device nvme keeps each rank's optimizer states in "
                            "its own swap files, which DeepSpeed's universal loading does not read: relaunch with "
                            f"{saved_world}")
    samples = checkpoint.saved_samples(step_dir)
    t = recipe.train
    per_step = t.grad_accum_steps * t.micro_batch_size * max(world // (tp * sequence), 1)
    if samples is None or resumed_shift(0, samples, per_step) is not None:
        return
    dp = per_step // (t.grad_accum_steps * t.micro_batch_size)
    raise UserError(f"--resume: {step_dir} was saved after {samples} samples, which is not a whole number of this "
                    f"launch's steps of {per_step} samples (train.grad_accum_steps {t.grad_accum_steps} x "
                    f"train.micro_batch_size {t.micro_batch_size} x {dp} data-parallel ranks): no step starts there; "
                    "choose a train.grad_accum_steps whose steps divide it")


def _check_world(step_dir: Path, saved_world: int, world: int, tp: int, sequence: int, stage: int) -> None:
    said = f"--resume: {step_dir} was saved by {saved_world} ranks, this launch has {world}"
    if stage != 3:
        raise UserError(f"{said}; a resume on another world size converts the checkpoint to DeepSpeed's universal "
                        f"format, which memtrain does for ZeRO stage 3 only (zero_optimization.stage is {stage}): "
                        f"relaunch with {saved_world}")
    if tp > 1 or sequence > 1:
        export = "" if tp > 1 else (", or export the step (python -m memtrain export RUN --step N) and start a new "
                                    "run from it with model.pretrained (the weights, not the optimizer's moments)")
        raise UserError(f"{said}; a resume on another world size is supported without tensor or sequence "
                        f"parallelism only ({_unverified(tp, sequence)}): relaunch with {saved_world}{export}")
    if checkpoint.saved_samples(step_dir) is None:
        raise UserError(f"{said}; it was saved before memtrain recorded the samples read (manifest.json 'samples'), "
                        f"so where the data continues on another world is unknown: relaunch with {saved_world}")


def _unverified(tp: int, sequence: int) -> str:
    """Why a world change with tensor or sequence parallelism is refused, for the refusal's line."""
    if tp > 1:
        return (f"tensor_parallel.autotp_size {tp}: DeepSpeed's ds_to_universal merges AutoTP slices and its ZeRO-3 "
                "universal loading slices them again, but memtrain has not checked that against a straight run")
    return (f"parallel.sequence {sequence}: Ulysses' ZeRO partitions span the sequence-parallel ranks, and the "
            "conversion and the data position of such a checkpoint are not checked against a straight run")


@dataclass(frozen=True)
class Conversion:
    path: Path
    saved_world: int
    world: int
    seconds: float
    now: bool  # converted by this launch (else reused)

    def line(self) -> str:
        how = f"converted in {self.seconds:.1f} s" if self.now else \
            f"reusing the conversion made earlier (it took {self.seconds:.1f} s)"
        return (f"resume: {self.path.parent.name} was saved by {self.saved_world} ranks, this run has {self.world}: "
                f"DeepSpeed's universal checkpoint {self.path} ({how}), loaded with load_universal")


def universal(step_dir: Path, saved_world: int, world: int) -> Conversion:
    """`step_dir` in DeepSpeed's universal format, converted once (DeepSpeed's own ds_to_universal, in a child
    process with a bounded number of workers) into a temporary directory renamed into place, so a kill mid-way
    leaves no partial `universal`; a later resume reuses it."""
    target = step_dir / checkpoint.UNIVERSAL
    if (target / RECORD).is_file():
        record = json.loads((target / RECORD).read_text())
        return Conversion(target, saved_world, world, float(record["seconds"]), now=False)
    for stale in step_dir.glob(f"{checkpoint.TMP_PREFIX}{checkpoint.UNIVERSAL}-*"):  # a conversion killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    tmp = step_dir / f"{checkpoint.TMP_PREFIX}{checkpoint.UNIVERSAL}-{os.getpid()}"
    started = time.perf_counter()
    _convert(step_dir, tmp)
    seconds = time.perf_counter() - started
    (step_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer, beside its output
    (tmp / RECORD).write_text(json.dumps({"saved_world": saved_world, "world": world, "seconds": seconds}))
    os.replace(tmp, target)
    return Conversion(target, saved_world, world, seconds, now=True)


def _convert(step_dir: Path, out: Path) -> None:
    workers = max(1, min(4, os.cpu_count() or 1))  # each extract worker holds one rank's optimizer shard
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(step_dir),
           "--output_folder", str(out), "--num_extract_workers", str(workers), "--num_merge_workers",
           str(max(1, workers // 2))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[-1]
        if "No space left" in last or "Disk quota" in last:
            raise UserError(f"--resume: disk full converting {step_dir} to DeepSpeed's universal format (a copy of "
                            "the whole fp32 weights and Adam moments, measured 1.5x the checkpoint for the tiny model; "
                            f"this one is {checkpoint.dir_bytes(step_dir) / 2**30:.2f} GiB): free space first")
        raise UserError(f"--resume: converting {step_dir} to DeepSpeed's universal format failed: {last} "
                        f"({' '.join(cmd)})")


def prepare(checkpoint_dir: Path, world: int) -> None:
    """The preflight's part (one process, before any worker): convert the checkpoint a resume on `world` ranks
    loads, so the workers reuse it instead of waiting on rank 0 within the collective timeout."""
    point = checkpoint.resume_point(checkpoint_dir)
    if point.world_size != world:
        universal(checkpoint_dir / point.tag, point.world_size, world)


@dataclass(frozen=True)
class Resumed:
    step: int  # the completed steps loaded
    shift: int  # data step = step + shift (memtrain.model.order.resumed_shift)
    line: str  # where the data continues, for rank 0 to print; "" where nothing changed


def resume(engine, checkpoint_dir: Path, per_step: int) -> Resumed:
    """Load the checkpoint rank 0 chose, converting it first (rank 0, once) where another world size saved it,
    and place the data: the next step reads the samples after those the checkpoint's steps read."""
    import deepspeed.comm as dist  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    point = checkpoint.chosen_point(checkpoint_dir)
    step_dir, world = checkpoint_dir / point.tag, dist.get_world_size()
    lines = []
    if point.world_size != world:
        if dist.get_rank() == 0:  # the others wait (within the collective timeout; `make train`'s preflight converts)
            lines.append(universal(step_dir, point.world_size, world).line())
        dist.barrier()
    step = checkpoint.load(engine, checkpoint_dir, point)
    samples = checkpoint.saved_samples(step_dir)
    shift = 0 if samples is None else resumed_shift(step, samples, per_step)
    if shift is None:  # preflight refused it (check); the directory changed since
        raise UserError(f"--resume: {step_dir}: {samples} samples read is not a whole number of steps of {per_step}")
    if samples is not None and (shift or point.world_size != world):
        lines.append(data_line(step, samples, per_step, shift))
    return Resumed(step, shift, "\n".join(lines))


def data_line(step: int, samples: int, per_step: int, shift: int) -> str:
    same = "as a straight run would" if shift == 0 else \
        f"the rows a straight run of this batch reads at step {step + 1 + shift}"
    return (f"resume data: {samples} samples read in {step} steps; step {step + 1} reads samples "
            f"[{samples}, {samples + per_step}) ({per_step} a step), {same}")

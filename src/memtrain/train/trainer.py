"""The training loop: DeepSpeed engine, per-layer AC plan, metrics to DeepSpeed's monitor."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from contextlib import nullcontext
from datetime import datetime, timedelta
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

import torch

from memtrain.train import checkpoint, reshard
from memtrain.train import run_dir as run_dirs
from memtrain.recompute.hooks import apply_plan, checkpoint_calls, configure_deepspeed_ac
from memtrain.config.args import RunArgs
from memtrain.config.saved_run import CONFIG_FILE
from memtrain.model.chat_data import PackedChat, report_line
from memtrain.model.data import PackedData, RandomTokens, blend_plan_line, prepare_data, to_device
from memtrain.model.eval_data import batches_per_rank, prepare_eval_data
from memtrain.model.freeze import freeze
from memtrain.model.lora import add_lora, trainable_patterns
from memtrain.train.final import save_final
from memtrain.config.ds_config import AUTO, model_hidden_size, offload_device, resolve_ds_config, tp_size, zero_stage
from memtrain.train import ds_log
from memtrain.train.loss_scale import scaler_row, skipped_warning
from memtrain.train.optimizer import engine_arguments, own_sections
from memtrain.errors import EXIT_RUN_FAILED, RunFailed, UserError, report_here
from memtrain.train.faults import (RunPosition, disk_full_message, is_oom, nonfinite_loss_message,
                                   nonfinite_weights_message, oom_message, write_failure)
from memtrain.memory.flops import device_peak_tflops, model_flops_per_token, recompute_flops_per_token
from memtrain.recompute.meter import ActivationMeter
from memtrain.recompute.compiled import CompiledLayers, CompileWatch, compile_line, compile_seconds
from memtrain.units import GIB
from memtrain.train.metrics import IntervalTimer, device_memory, host_rss_gib, medians, reset_device_peak
from memtrain.model.build import build_model
from memtrain.model.zero_init import build_model_zero3
from memtrain.recompute import partition
from memtrain.train import parallel
from memtrain.train import rng
from memtrain.train.preflight import check_host_memory, resolve_run
from memtrain.train import long_context
from memtrain.train import gloo_env, signals
from memtrain.train.node import agent_ranks
from memtrain.train.evaluate import evaluate
from memtrain.train.zero3_probe import OpCounter, Zero3Probe, summarize



def single_process_env() -> Optional[str]:
    """`python src/train.py` without a launcher: a world of one, whatever WORLD_SIZE a shell left behind (a warning
    then: without a launcher's RANK no other rank will join)."""
    if "RANK" in os.environ:
        return None
    left = os.environ.get("WORLD_SIZE", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if left.strip() != "1":
        return (f"WORLD_SIZE={left} is set in the environment, but no launcher started this process (no RANK): it "
                "trains as one process (start it with deepspeed or torchrun for more ranks, or unset WORLD_SIZE)")
    return None


def cpu_threads(cuda: bool, host_optimizer: bool, env=os.environ) -> Optional[int]:
    """Threads for this rank's CPU work: the cores this process may use (a cgroup, taskset or Slurm binding;
    under Slurm a launcher owns only its task's CPUs) split among the node's ranks. On CPU every op runs there
    (oversubscribed threads stall every collective); on a GPU node only an offloaded optimizer (DeepSpeed's CPU
    Adam, OpenMP) does, where torchrun's OMP_NUM_THREADS=1 for several ranks per node would leave it one core.
    None: leave the launcher's setting."""
    if cuda and not host_optimizer:
        return None
    local_world = agent_ranks(int(env.get("WORLD_SIZE", 1)), env)
    cores = int(env.get("SLURM_CPUS_PER_TASK", 0)) or len(os.sched_getaffinity(0)) or 1
    return max(1, cores // local_world)


def _share_cpu_cores(ds_config: dict) -> None:
    threads = cpu_threads(torch.cuda.is_available(), offload_device(ds_config, "optimizer") != "none")
    if threads is not None:
        torch.set_num_threads(threads)


def _skip_shm_comm_op() -> None:
    """DeepSpeed JIT-builds its CPU shm comm op at init_distributed on a CPU accelerator (minutes on a
    busy 2-core machine, and rebuilt whenever two ninja binaries share its build folder). The op only
    serves DeepSpeed's inference all-reduce; ZeRO training on gloo never calls it. Marking it
    incompatible makes DeepSpeed 0.19.8's `build_shm_op()` return None (deepspeed/comm/torch.py). Only on a CPU
    accelerator: elsewhere DeepSpeed does not build it, and reading the table would probe every CUDA op (nvcc runs)."""
    try:
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            return
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError):
        pass


def _groups_wait_as_long_as_the_world(timeout: timedelta) -> None:
    """torch's new_group takes its own default timeout (gloo 30 min, NCCL 10 min), not the world group's, and
    DeepSpeed makes its tensor-, data- and sequence-parallel groups without one: a rank waiting on a lost peer
    in one of them would outwait train.collective_timeout_s by far. Every group made from here on takes it.
    (torch reads these module globals at each new_group; there is no public setter.)"""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def _meet(timeout: timedelta) -> None:
    """The ranks' rendezvous. A rank that stopped before it (a check that failed on its node printed its own
    line) leaves the others waiting here until train.collective_timeout_s: one line, from rank 0, not torch's
    traceback of the store's wait."""
    import deepspeed

    try:
        deepspeed.init_distributed(verbose=False, timeout=timeout)
    except torch.distributed.DistStoreError as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        joined = re.search(r"(\d+)/(\d+) clients joined", str(e))
        who = (f"{joined.group(1)} of {joined.group(2)} ranks joined" if joined else
               f"not all {os.environ.get('WORLD_SIZE', '?')} ranks joined")
        raise RunFailed(f"the ranks did not all meet at the rendezvous {where} within train.collective_timeout_s "
                        f"({timeout.total_seconds():g} s): {who} ({str(e).splitlines()[0]}); a rank that stopped "
                        "before the rendezvous says why in its own line above (or in its launcher's log, on its "
                        "node), and one that never started is missing from its launcher") from None


def set_local_device() -> torch.device:
    """This rank's device, set from LOCAL_RANK before anything touches CUDA: the first collectives
    (object broadcasts, NCCL's communicator) then use it, not cuda:0 on every rank."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


SLURM_SAVE_EVERY_MINUTES = 30.0  # a Slurm job's default: a requeue after a lost node loses at most this much


def save_every_s(train) -> Optional[float]:
    """Seconds between timed model checkpoints (train.save_every_minutes; in a Slurm job 30 minutes by default,
    since its requeue resumes from the newest checkpoint); None: no timed saves."""
    minutes = train.save_every_minutes
    if minutes is None and "SLURM_JOB_ID" in os.environ:
        minutes = SLURM_SAVE_EVERY_MINUTES
    return minutes * 60 if minutes and train.save_checkpoints else None


def log_every(train, raw_ds_config: dict) -> int:
    """train.log_every, else the JSON's steps_per_print, else 10."""
    return int(train.log_every or raw_ds_config.get("steps_per_print") or 10)


def is_boundary(done: int, t, every: int) -> bool:
    """Steps after which the ranks synchronise: log, the end of the metric warm-up, a save, the last.
    A pure function of the step, so every rank stops at the same ones."""
    return (done % every == 0 or done == t.max_steps or done == t.metric_warmup_steps
            or bool(t.save_interval and done % t.save_interval == 0) or eval_due(done, t))


def eval_due(done: int, t) -> bool:
    """Steps after which the held-out data is evaluated (when there is some): every train.eval_every, and the last."""
    return done == t.max_steps or bool(t.eval_every and done % t.eval_every == 0)


def _check_the_nodes_host_memory(checked, world: int) -> None:
    """The host-memory check again, with every rank on this host counted: several launcher agents on one node (2 x 4
    ranks instead of 1 x 8) each saw only their own ranks before the ranks met. One all-gather of host names."""
    import deepspeed.comm as dist

    if world == 1:
        return
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    here = hosts.count(socket.gethostname())
    if here > agent_ranks(world):
        prediction = checked.memory_plan.prediction if checked.memory_plan is not None else checked.prediction
        check_host_memory(prediction, world, ranks_on_node=here, final=checked.final_bytes)


def _choose_run_dir(args: RunArgs, rank: int) -> tuple[Path, Optional[str]]:
    """The run directory (one timestamp for all ranks), held by rank 0 for the run (run_dir.lock): a second run on it
    is refused on every rank; a warning where its file system has no file locks."""
    import deepspeed.comm as dist

    chosen: list = [None]
    if rank == 0:
        path = args.run_dir or Path(f"runs/{args.recipe.name}-{datetime.now():%Y%m%d-%H%M%S}")
        chosen = [(str(path), *run_dirs.lock(path))]
    dist.broadcast_object_list(chosen, src=0)
    path, refusal, warning = chosen[0]
    if refusal:
        raise UserError(refusal)
    return Path(path), warning


def train(args: RunArgs) -> dict:
    """Train; a NaN/inf loss or an OOM ends it with one line and summary.json status failed/oom."""
    alone = single_process_env()  # first: validation sizes batches by this world
    if alone:
        print(f"warning: {alone}", flush=True)
    progress = RunPosition(world=int(os.environ.get("WORLD_SIZE", 1)), rank=int(os.environ.get("RANK", 0)))
    try:
        return _train_or_report(args, progress)
    except BaseException:  # --overwrite: the new run saved nothing, so the earlier run comes back
        run_dirs.roll_back(progress.run_dir)
        raise
    finally:
        run_dirs.unlock(progress.run_dir)


def _train_or_report(args: RunArgs, progress: RunPosition) -> dict:
    try:
        try:
            return _train(args, progress)
        finally:
            if progress.bar is not None:
                progress.bar.close()  # an error line must not share a line with the bar
    except RunFailed as e:  # non-finite loss: every rank sees the same all-reduced value
        if progress.rank == 0:
            write_failure(progress, "failed", str(e))
        raise
    except Exception as e:
        if not is_oom(e):
            raise
        reason = oom_message(progress, args.recipe, args.ds_config)
        write_failure(progress, "oom", reason)
        run_dirs.roll_back(progress.run_dir)
        if progress.world == 1:
            raise RunFailed(reason) from None
        # Other ranks may wait in a collective forever: report from this rank and leave at once;
        # the launcher then stops the rest.
        report_here(reason)
        os._exit(EXIT_RUN_FAILED)


def _train(args: RunArgs, progress: RunPosition) -> dict:
    """A run in three phases: set up (checks, ranks, run directory, engine), the step loop, and the end
    (model checkpoint, final/, summary.json)."""
    run = _start(args, progress)
    steps = _steps(run, progress)
    return _finish(run, steps)


@dataclass
class _Run:
    """What the set-up hands to the step loop and the end of the run."""

    args: RunArgs
    world: int
    rank: int
    checked: Any  # memtrain.train.preflight.Checked
    plan: Any  # the ACPlan every rank runs (rank 0's under policy auto)
    memory_plan: Any
    run_dir: Path
    predicted_peak: Optional[int]
    data: Any
    agreement: Any  # signals.StopAgreement
    engine: Any
    longctx: Any
    layout: Any
    compiled: bool  # train.compile, as rank 0 decided
    eval_data: Any = None  # held-out rows (memtrain.model.eval_data), or None


@dataclass
class _Steps:
    """What the step loop did."""

    start: int
    done: int
    status: str
    stop_signal: Optional[str]
    last_loss: float
    history: list
    measured_steps: int
    started: float
    probe: Any
    compiles: Any  # memtrain.recompute.compiled.CompileWatch under train.compile, else None
    last_eval: Any = None  # memtrain.train.evaluate.EvalResult of the last eval, or None
    shift: int = 0  # the data's step is the step + shift (a resume on another batch size: train/reshard.py)


def _start(args: RunArgs, progress: RunPosition) -> _Run:
    """Every check before any distributed work (the one `make train` runs first), the ranks, the run directory and
    its plan lines, the model with its AC hooks and the DeepSpeed engine."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    recipe = args.recipe
    t = recipe.train
    world = int(os.environ.get("WORLD_SIZE", 1))
    set_local_device()  # before validation: policy auto times this rank's own device

    # --- validate everything before any distributed work: the same check `make train` runs first
    checked = resolve_run(args, world)
    config, plan = checked.config, checked.plan

    # --- distributed set-up
    import deepspeed
    import deepspeed.comm as dist

    signals.install()  # src/train.py did already, first thing; an in-process caller gets it here
    _share_cpu_cores(args.ds_config)
    _skip_shm_comm_op()
    # The corpus is packed before the rendezvous: ranks wait on the cache's file lock, not in a collective
    # that a long packing would time out (memtrain.model.data.prepare_data).
    data = RandomTokens(config.vocab_size, recipe.data.seq_len, t.seed) if recipe.data.random_tokens else \
        prepare_data(recipe.data, t.seed)
    eval_data = prepare_eval_data(recipe.data, t.seed)  # packed the same way, before the ranks meet
    gloo_warning = gloo_env.prepare(world)  # descriptors for gloo's sockets, an address other nodes reach
    timeout = timedelta(seconds=t.collective_timeout_s)
    _meet(timeout)
    _groups_wait_as_long_as_the_world(timeout)
    rank = dist.get_rank()
    _check_the_nodes_host_memory(checked, world)
    # a stop signal on any rank stops all within two steps; rank 0's clock decides timed saves
    agreement = signals.StopAgreement(world, save_every_s(t), rank)
    memory_plan, compiled = checked.memory_plan, checked.compile
    if memory_plan is not None or t.compile == "auto":
        # policy auto: every rank planned on its own device (set above), but they must all run one
        # plan: rank 0's. Per-rank plans could differ by timing noise, and a rank that recomputes
        # less than the others would be the one to run out of memory first. train.compile auto: each rank read
        # its own node's gpu-check figures; all compile, or none, as rank 0 decided.
        shared = [plan, memory_plan, compiled]
        dist.broadcast_object_list(shared, src=0)
        plan, memory_plan, compiled = shared
    run_dir, lock_warning = _choose_run_dir(args, rank)
    progress.run_dir = run_dir
    ds_log.buffer()  # DeepSpeed's own log: off the console, to run_dir/deepspeed.log below
    ds_config = checked.zero3.apply(resolve_ds_config(args.ds_config, recipe, world, run_dir, plan.checkpoint_calls,
                                                      hidden_size=model_hidden_size(config), default_tensorboard=True))
    # the plan every rank runs: rank 0's, for policy auto (its prediction came with it)
    predicted_peak = (memory_plan.prediction if memory_plan is not None else checked.prediction).peak
    if rank == 0:
        if args.overwrite:  # the earlier run moves aside; deleted once this run saved a model checkpoint
            run_dirs.set_aside(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        earlier = _earlier_segments(run_dir) if args.resume else []
        _write_config(run_dir, args, ds_config, world, plan, earlier)
        if args.resume_changes:  # --resume continues the run's saved inputs; what this launch changes of them
            print(f"resume overrides: {'; '.join(args.resume_changes)}", flush=True)
        print(plan.describe(), flush=True)
        for line in checked.zero3.lines:
            print(f"  {line}", flush=True)
        for line in checked.model_lines:
            print(line, flush=True)
        if compiled.line:
            print(compiled.line, flush=True)
        if isinstance(data, PackedChat):  # what was packed, how full the rows are, what was skipped and why
            print(report_line(data.report, recipe.data), flush=True)
        if recipe.data.sources:  # each source's tokens, share of the rows and epochs this run takes of it
            dp = world // (tp_size(args.ds_config) * recipe.parallel.sequence)
            print(blend_plan_line(data, t.max_steps * t.micro_batch_size * t.grad_accum_steps * dp), flush=True)
        if memory_plan is not None:
            print(memory_plan.describe(), flush=True)
        if agreement.save_every_s and t.save_checkpoints:  # what a requeue after a lost node resumes from
            why = "train.save_every_minutes" if t.save_every_minutes else "a Slurm job's default"
            print(f"model checkpoints: every {agreement.save_every_s / 60:g} min of training ({why})"
                  + (f", every {t.save_interval} steps" if t.save_interval else "") + ", on a stop signal and at the end",
                  flush=True)
        for warning in checked.warnings + tuple(w for w in (lock_warning, gloo_warning) if w):
            print(f"warning: {warning}", flush=True)
    dist.barrier()  # the run directory is ready (an earlier run's files set aside) before any rank writes to it
    run_dirs.check_shared(run_dir, rank)  # every node sees it (one line, on every rank, where one does not)
    ds_log.to_file(run_dir, rank)

    # --- model, AC hooks, engine
    engine, longctx, layout, number_changed = build_engine(recipe, config, plan, ds_config, args.ds_config, checked.spec,
                                                           compiled=compiled.on)
    if rank == 0:
        print("\n".join(longctx.lines), flush=True)
        if number_changed:  # number_checkpoints "auto": the modules matched are known now
            _write_config(run_dir, args, ds_config, world, plan, earlier)
    return _Run(args, world, rank, checked, plan, memory_plan, run_dir, predicted_peak, data, agreement, engine,
                longctx, layout, compiled.on, eval_data)


def _steps(run: _Run, progress: RunPosition) -> _Steps:
    """The training loop, from a resumed step if any; no host-device sync inside a step (see below). Longer than
    the house's 80 lines on purpose: the steady state and the one boundary that syncs read best side by side."""
    import deepspeed.comm as dist
    from tqdm import tqdm

    args, engine, layout, plan, world, rank = run.args, run.engine, run.layout, run.plan, run.world, run.rank
    recipe, config, run_dir, agreement, data = args.recipe, run.checked.config, run.run_dir, run.agreement, run.data
    t = recipe.train
    sp, device = run.longctx.sp, engine.device  # every tensor that meets a collective lives on `device`
    rng.seed_everything(t.seed, layout, rank)  # dropout streams: one per data-parallel rank (a TP group shares it)
    # restores the RNG streams too; a checkpoint of another world size through its universal copy (train/reshard.py)
    resumed = reshard.resume(engine, run_dir / "checkpoints", _samples_per_step(t, layout)) if args.resume else None
    start, shift = (resumed.step, resumed.shift) if resumed else (0, 0)  # the data reads step + shift
    if resumed and resumed.line and rank == 0:
        print(resumed.line, flush=True)
    progress.step = start

    flops_per_token = model_flops_per_token(config, recipe.data.seq_len)
    recompute = _recompute_flops(config, recipe.data.seq_len, plan)
    hardware_flops_per_token = None if recompute is None else flops_per_token + recompute
    peak_tflops = t.peak_tflops or device_peak_tflops()
    tokens_per_step = layout.tokens_per_step(t.micro_batch_size, t.grad_accum_steps, recipe.data.seq_len)
    every = log_every(t, args.ds_config)
    eval_batches = 0 if run.eval_data is None else \
        batches_per_rank(len(run.eval_data), t.eval_batches, layout.dp_size, t.micro_batch_size, t.grad_accum_steps)
    last_eval = None
    meter = ActivationMeter()
    timer = IntervalTimer(device)
    history: list[dict[str, float]] = []
    measured_steps = 0
    status, done, last_loss = "completed", start, float("nan")
    started = time.time()
    stop_signal = _stopped_in_start_up(device, world)  # nothing trained, nothing saved: a requeue starts cleanly
    if stop_signal:
        status = "preempted"

    bar = progress.bar = tqdm(total=t.max_steps, initial=start, disable=rank != 0, desc=recipe.name, unit="step",
                              dynamic_ncols=True)
    # Steady state: no host-device sync inside a step. Per-step losses stay on the device until the
    # next boundary (`is_boundary`), where one all-reduce carries them and the stop flags, and one
    # read brings them to the host: the NaN check, the stop agreement and logging happen there.
    step_losses: list[torch.Tensor] = []
    # chat/instruction rows end in padding: tokens/s and MFU count the real tokens, summed over the data ranks in
    # the boundary's all-reduce (each rank of a TP/SP group read the same batch: dp_size / world of each counts)
    count_real = not isinstance(data, (RandomTokens, PackedData))
    interval_tokens = 0
    interval_start = start
    reset_device_peak()
    timer.start()
    probe = _start_probe(engine) if t.probe else None
    deadline = StopDeadline(t.stop_deadline_s, t.metric_warmup_steps)
    compiles = CompileWatch() if run.compiled else None
    for step in range(start, start if stop_signal else t.max_steps):
        measure = step == interval_start  # activation bytes of one forward per interval
        loss_sum = torch.zeros((), device=device)
        # the step's labelled tokens, every rank's, from the data itself (no collective): the loss is their mean
        divisor = layout.loss_divisor(data.labelled_tokens(step + shift, layout.dp_size, t.micro_batch_size,
                                                           t.grad_accum_steps), t.grad_accum_steps)
        count_ops = probe is not None and step == start + 2  # one step, after ZeRO-3 recorded its trace
        with OpCounter() if count_ops else nullcontext() as ops:
            for micro in range(t.grad_accum_steps):
                batch = data.batch(step + shift, micro, layout.dp_rank, layout.dp_size, t.micro_batch_size,
                                   t.grad_accum_steps)
                if count_real:
                    interval_tokens += batch.pop("tokens")
                ids = to_device(batch, device)
                with meter.measure() if measure and micro == 0 else nullcontext():
                    loss = engine(**sp.slice_batch(ids), loss_divisor=divisor).loss
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
        if probe:
            probe.step_done(engine, {"aten_ops": ops.ops} if count_ops else None)
        step_losses.append(loss_sum)
        done = step + 1
        bar.update(1)
        if compiles is not None:  # host-side counters: no device sync
            _report_compiles(compiles, step, done, start, t.max_steps, rank, bar, meter.bytes,
                             _planned_activations(run))
        agreed = agreement.step()  # signals any rank had by the end of the previous step
        if not (is_boundary(done, t, every) or agreed or agreement.save_due):
            continue

        # --- boundary: one all-reduce, one host read
        seconds = timer.stop()
        counted = [interval_tokens * layout.dp_size / world] if count_real else []
        stats = torch.cat([torch.stack(step_losses), torch.tensor(signals.one_hot() + counted, device=device)])
        dist.all_reduce(stats)
        values = stats.tolist()
        # each replica's micro-step losses sum to its tokens' share of the step's token mean, times
        # grad_accum * dp_size (Layout.loss_divisor); every rank of a TP/SP group holds its replica's value
        losses = [v / (world * t.grad_accum_steps) for v in values[:len(step_losses)]]
        stopped = agreed or signals.names(values[len(step_losses):len(values) - len(counted)])
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        if bad is not None:  # stop before anything saves it; the last checkpoint stays good
            progress.step = interval_start + bad
            raise RunFailed(nonfinite_loss_message(losses[bad], interval_start + bad + 1, t.max_steps, run_dir, t))
        last_loss = losses[-1]
        progress.step = done
        steps = done - interval_start
        real_per_step = values[-1] / steps if count_real else tokens_per_step
        row = _interval_metrics(engine, sum(losses) / steps, seconds / steps, real_per_step, world,
                                layout.dp_size * t.micro_batch_size * t.grad_accum_steps, flops_per_token,
                                hardware_flops_per_token,
                                peak_tflops, meter.bytes)
        row.update(scaler_row(engine))
        deadline.check(seconds / steps, rank)
        if run.predicted_peak is not None:  # memtrain's prediction, beside the measured figures
            row["memory/predicted_peak_gib"] = run.predicted_peak / GIB
        if plan.memtrain_offload:  # host bytes that memtrain's cpu_checkpointing took off the device
            row["memory/offloaded_activation_gib"] = meter.offloaded_bytes / GIB
        if interval_start >= t.metric_warmup_steps or t.max_steps <= t.metric_warmup_steps:
            history.append(row)
            measured_steps += steps
        else:  # warm-up: keep loss/lr/memory in TensorBoard, but no throughput figures
            row = {k: v for k, v in row.items() if not k.startswith(("throughput/", "time/"))}
        if eval_batches and eval_due(done, t) and not stopped:  # after the interval's clock stopped: not timed
            last_eval = evaluate(engine, run.eval_data, sp, layout, eval_batches, t.micro_batch_size)
            row = {**row, **last_eval.metrics()}  # a new row: the history keeps training's figures only
            if compiles is not None:  # eval's no-grad forward compiles each layer once more: expected, not late
                compiles.step_done(step, warmed_up=False)
        engine.monitor.write_events([(tag, value, done) for tag, value in row.items()])
        shown = {"loss": f"{last_loss:.3f}"}
        if "throughput/tokens_per_s" in row:  # measured only after the warm-up: no made-up 0 before it
            shown["tok_s"] = f"{row['throughput/tokens_per_s']:,.0f}"
        if last_eval is not None:
            shown["eval"] = f"{last_eval.loss:.3f}"
        bar.set_postfix(**shown, act_gib=f"{row['memory/activation_gib']:.3f}")
        step_losses, interval_start, interval_tokens = [], done, 0
        if stopped:
            stop_signal = signals.received() or stopped[0]  # for summary.json, on every rank
            status = "preempted"
            break
        if t.save_checkpoints and done < t.max_steps and (
                agreement.save_due or (t.save_interval and done % t.save_interval == 0)):
            saving = time.monotonic()
            _save_checked(engine, run_dir, done, t, layout, shift)
            deadline.save_s = time.monotonic() - saving
            agreement.saved()
        reset_device_peak()
        timer.start()
    bar.close()
    agreement.close()

    return _Steps(start, done, status, stop_signal, last_loss, history, measured_steps, started, probe, compiles,
                  last_eval, shift)


def _finish(run: _Run, steps: _Steps) -> dict:
    """The last model checkpoint, final/ and summary.json, then the process group closed."""
    import deepspeed.comm as dist

    args, engine, layout, plan, world, rank = run.args, run.engine, run.layout, run.plan, run.world, run.rank
    recipe, config, run_dir, memory_plan = args.recipe, run.checked.config, run.run_dir, run.memory_plan
    t, device, probe, history = recipe.train, engine.device, steps.probe, steps.history
    start, done, status, last_loss = steps.start, steps.done, steps.status, steps.last_loss
    completed = done if status == "preempted" else t.max_steps
    if t.save_checkpoints and completed > start:  # a stop during start-up trained nothing: nothing to save
        _save_checked(engine, run_dir, completed, t, layout, steps.shift)
    if t.save_checkpoints and status == "completed":  # final/: loads with transformers' from_pretrained
        save_final(engine, engine.module, run_dir / "final", recipe, lambda: build_model(recipe.model, config))
    summary = {
        "status": status,
        "steps": completed,
        "stop_signal": steps.stop_signal,
        "final_loss": last_loss,
        "metrics": medians(history, 0),
        "measured_steps": steps.measured_steps,
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "elapsed_s": time.time() - steps.started,
        "ac_plan": plan.to_dict(),
        "run_dir": str(run_dir),
        "tensorboard": str(run_dir / "tb"),
    }
    summary.update({k.partition("/")[2]: v for k, v in scaler_row(engine).items()})
    summary["skipped_steps"] = int(summary["skipped_steps"])
    if steps.last_eval is not None:  # the last eval of this segment (a resumed run's too)
        summary.update(eval_loss=steps.last_eval.loss, eval_perplexity=steps.last_eval.perplexity,
                       eval_tokens=steps.last_eval.tokens)
    if run.predicted_peak is not None:
        summary["predicted_peak_gib"] = run.predicted_peak / GIB
    if device.type == "cuda":
        summary["peak_allocated_gib"] = max((r["memory/peak_allocated_gib"] for r in history), default=0.0)
    if memory_plan is not None:
        summary["memory_plan"] = memory_plan.to_dict()
    if steps.compiles is not None:
        summary["compile"] = {"compiles": steps.compiles.compiles, "seconds": compile_seconds(),
                              "recompiles_after_warmup": steps.compiles.late}
    if probe is not None:
        probe.__exit__(None, None, None)
        summary["probe"] = {**summarize(probe.steps), "per_step": probe.steps}
    skipped = skipped_warning(summary["skipped_steps"], completed - start)
    if rank == 0:
        checkpoint.atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        run_dirs.finish_overwrite(run_dir)  # with train.save_checkpoints: false, nothing saved before
        if skipped:
            print(f"warning: {skipped}", flush=True)
        if status == "preempted":  # stopped: the command that continues it (its inputs come from config.json)
            then = f"; continue with: --resume --run-dir {run_dir}"
        else:
            then = f"; model: {run_dir / 'final'}" if (run_dir / "final").is_dir() else ""
        held_out = "" if steps.last_eval is None else \
            f", eval loss {steps.last_eval.loss:.4f} (perplexity {steps.last_eval.perplexity:.2f})"
        print(f"{status}: {completed} steps, final loss {last_loss:.4f}{held_out}; "
              f"TensorBoard logs: {run_dir / 'tb'} (tensorboard --logdir {run_dir / 'tb'}){then}", flush=True)
    dist.barrier()
    # Close the process group before the interpreter exits: left to interpreter shutdown, gloo's
    # threads were seen to abort a finished rank ("terminate called without an active exception").
    dist.destroy_process_group()
    return summary


COMPILE_WARMUP_STEPS = 2  # steps that may compile: the first forward and backward, and a graph-mode change


def _planned_activations(run: _Run) -> Optional[int]:
    prediction = run.memory_plan.prediction if run.memory_plan is not None else run.checked.prediction
    return getattr(prediction, "saved_activations", None)


def _report_compiles(compiles: CompileWatch, step: int, done: int, start: int, max_steps: int, rank: int, bar,
                     measured: int, planned: Optional[int]) -> None:
    """train.compile: a warning for each compile after the warm-up (with dynamo's reason), and the compile line
    once the warm-up is over (with the measured activations against the plan's eager prediction)."""
    lines = compiles.step_done(step, warmed_up=done > start + COMPILE_WARMUP_STEPS)
    if rank != 0:
        return
    for line in lines:
        bar.write(f"warning: {line}")
    if done == min(start + COMPILE_WARMUP_STEPS, max_steps):
        bar.write(compile_line(compiles, measured, planned))


class StopDeadline:
    """train.stop_deadline_s: warn (once, rank 0) when a stop, up to 2 steps and then a save, would outlast it.
    Step time is measured after the metric warm-up; save time once a save ran (until then it is left out)."""

    def __init__(self, deadline_s: Optional[float], warmup_steps: int) -> None:
        self.deadline_s, self.warmup_steps = deadline_s, warmup_steps
        self.save_s: Optional[float] = None
        self.intervals = 0
        self.warned = False

    def check(self, step_s: float, rank: int) -> None:
        self.intervals += 1
        if self.deadline_s is None or self.warned or rank != 0 or self.intervals == 1 and self.warmup_steps:
            return  # the first interval holds the warm-up steps
        needed = 2 * step_s + (self.save_s or 0.0)
        if needed > self.deadline_s:
            self.warned = True
            save = f" and a save ({self.save_s:.1f} s)" if self.save_s else " (a save not yet measured)"
            print(f"warning: a stop signal may arrive {self.deadline_s:g} s before the job is killed "
                  f"(train.stop_deadline_s), but stopping takes up to 2 steps (2 x {step_s:.1f} s){save} = "
                  f"{needed:.0f} s: ask Slurm for a longer warning (sbatch --signal=B:USR1@SECONDS, and "
                  "MEMTRAIN_SIGNAL_LEAD_S for slurm/train.sbatch) or save more often", flush=True)


def _stopped_in_start_up(device, world: int) -> Optional[str]:
    """A stop signal any rank got before the first step (one all-reduce, before the loop): its name, or None."""
    import deepspeed.comm as dist

    flags = torch.tensor(signals.one_hot(), device=device)
    if world > 1:
        dist.all_reduce(flags)
    stopped = signals.names(flags.tolist())
    if stopped and int(os.environ.get("RANK", 0)) == 0:
        print(f"preempted during start-up ({stopped[0]}): no step run, nothing saved", flush=True)
    return (signals.received() or stopped[0]) if stopped else None


def _samples_per_step(t, layout) -> int:
    """Global samples one optimizer step reads (memtrain.model.order)."""
    return t.grad_accum_steps * t.micro_batch_size * layout.dp_size


def _save_checked(engine, run_dir: Path, step: int, t, layout, shift: int) -> None:
    """A model checkpoint of finite weights only (so "last good checkpoint" always names a usable one), and only
    where it fits: the ranks agree on both before anyone writes, so a full disk is one line, not a torn save. The
    manifest records the samples read, where a resume on another batch size continues."""
    tp_size = layout.tp
    import deepspeed.comm as dist

    if not checkpoint.weights_finite(engine):
        raise RunFailed(nonfinite_weights_message(step, t.max_steps, run_dir, t))
    checkpoint_dir = run_dir / "checkpoints"
    needed, how = checkpoint.space_needed(engine, checkpoint_dir, tp_size)
    free = checkpoint.free_bytes(checkpoint_dir)
    short = torch.tensor(float(free < needed), device=engine.device)
    dist.all_reduce(short)  # any rank's filesystem (node-local storage) too small: all stop
    if short.item():
        raise RunFailed(disk_full_message(step, run_dir, needed, how, free))
    try:
        samples = (step + shift) * _samples_per_step(t, layout)
        checkpoint.save(engine, checkpoint_dir, step, t.keep_last, tp_size, samples)
    except (OSError, RuntimeError) as e:  # filled by someone else meanwhile: this rank cannot go on
        if not checkpoint.is_disk_full(e):
            raise
        checkpoint.remove_partial(checkpoint_dir, step)
        message = disk_full_message(step, run_dir, needed, how, checkpoint.free_bytes(checkpoint_dir))
        if dist.get_world_size() == 1:
            raise RunFailed(message) from None
        # other ranks may wait in a collective of the save: report from this rank and leave (the launcher stops
        # the rest), as an out-of-memory rank does
        write_failure(RunPosition(dist.get_world_size(), dist.get_rank(), run_dir, step), "failed", message)
        report_here(message)
        os._exit(EXIT_RUN_FAILED)


def _start_probe(engine):
    """train.probe: ZeRO-3's per-step counters (memtrain.train.zero3_probe) around the training loop."""
    from memtrain.model.build import decoder_layers

    return Zero3Probe(engine.module, list(decoder_layers(engine.module)[1])).__enter__()


def build_engine(recipe, config, plan, ds_config: dict, raw_ds_config: dict, spec, compiled: bool = False):
    """The model (built partitioned under ZeRO-3, with transformers' own initialisation), the AC plan's
    hooks (each decoder layer compiled with `compiled`: train.compile) and the DeepSpeed engine: (engine,
    long-context set-up, data layout, whether the JSON's "auto" number_checkpoints changed now that the plan met
    the model; `ds_config` then holds the new value)."""
    import deepspeed

    rng.seed_everything(recipe.train.seed)  # the same initial weights on every rank
    stage = zero_stage(ds_config)
    if stage == 3:  # built partitioned, with transformers' own initialisation
        model = build_model_zero3(recipe.model, config, ds_config)
    else:
        model = build_model(recipe.model, config)
    if recipe.model.lora is not None:  # adapters in place; deepspeed.initialize partitions them under ZeRO-3
        add_lora(model, recipe.model.lora)
    # before DeepSpeed sees which parameters train; model.lora.modules_to_save's train whole, in place
    freeze(model, trainable_patterns(model, recipe.model.lora, recipe.train.trainable), recipe.train.frozen)
    # tiled MLP, sequence parallel, loss
    longctx = long_context.prepare(model, recipe, stage, tp_size(ds_config))
    # the model, not its layer list: module-path patterns are relative to it
    apply_plan(model, plan, CompiledLayers(plan.op_save) if compiled else None)
    changed = False
    ac_json = raw_ds_config.get("activation_checkpointing")
    if isinstance(ac_json, dict) and ac_json.get("number_checkpoints", AUTO) == AUTO:  # modules are known now
        calls = max(1, checkpoint_calls(model, plan))
        changed = calls != ds_config["activation_checkpointing"]["number_checkpoints"]
        ds_config["activation_checkpointing"]["number_checkpoints"] = calls
    model.train()
    # no optimizer/scheduler section: memtrain's own AdamW and the recipe's schedule (as HF's Trainer)
    engine, *_ = deepspeed.initialize(**engine_arguments(model, ds_config, recipe), mpu=longctx.mpu)
    layout = parallel.layout(engine, longctx.sp)  # which batch this rank reads; tokens counted once
    parallel.check_sharded(engine.module, layout.tp)
    rng.install(engine.module, config, layout, engine.device)  # sharded heads: per-TP-rank attention masks
    if plan.backend == "deepspeed":  # after initialize, which creates the tensor-parallel group
        configure_deepspeed_ac(spec, ds_config.get("activation_checkpointing", {}).get("number_checkpoints"),
                               partition.tp_mpu(plan, layout.tp))
        partition.check_configured(plan, layout.tp)
    return engine, longctx, layout, changed


def _write_config(run_dir: Path, args: RunArgs, ds_config: dict, world: int, plan, earlier: list) -> None:
    """config.json: the recipe and the resolved DeepSpeed JSON (every "auto" filled) this run segment uses, the JSON
    as written (what a `--resume` continues with: memtrain.config.saved_run), and each earlier segment's record."""
    record = {"recipe": args.recipe.model_dump(), "deepspeed": ds_config, "deepspeed_path": args.ds_config_path,
              "deepspeed_as_written": args.ds_config, "world_size": world, "ac_plan": plan.to_dict()}
    record.update(own_sections(ds_config, args.recipe))  # what memtrain builds for missing sections
    if args.resume:
        record["resume_changes"] = list(args.resume_changes)
    record["earlier_segments"] = earlier
    checkpoint.atomic_write_text(run_dir / CONFIG_FILE, json.dumps(record, indent=2))


def _earlier_segments(run_dir: Path) -> list:
    """A resumed run's config.json records, oldest first, before this segment's replaces it (a damaged one is none)."""
    try:
        record = json.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict):
        return []
    earlier = record.pop("earlier_segments", [])
    return (earlier if isinstance(earlier, list) else []) + [record]


def _recompute_flops(config, seq_len: int, plan) -> Optional[float]:
    """FLOPs per token the plan's recompute adds (memtrain.memory.flops' model of torch's checkpoint); None
    where that model has no answer (module-pattern plans)."""
    if plan.modules:
        return None
    try:
        return recompute_flops_per_token(config, seq_len, tuple(plan.layers))
    except ValueError:
        return None


def _interval_metrics(engine, loss, step_s, tokens_per_step, world, samples_per_step, flops_per_token,
                      hardware_flops_per_token, peak_tflops, activation_bytes) -> dict[str, float]:
    """One TensorBoard point per log interval: means over its steps, peaks over its steps."""
    allocated, reserved = device_memory()
    tokens_per_s = tokens_per_step / step_s
    tflops = flops_per_token * tokens_per_step / world / step_s / 1e12
    row = {
        "train/loss": loss,
        "train/lr": float(engine.get_lr()[0]),
        "throughput/tokens_per_s": tokens_per_s,
        "throughput/samples_per_s": samples_per_step / step_s,
        "throughput/tflops_per_device": tflops,
        "time/step_s": step_s,
        "memory/peak_allocated_gib": allocated,
        "memory/peak_reserved_gib": reserved,
        "memory/activation_gib": activation_bytes / GIB,
        "memory/host_rss_gib": host_rss_gib(),
    }
    if peak_tflops:  # MFU: model FLOPs only; HFU: with what the AC plan recomputes
        row["throughput/mfu"] = tflops / peak_tflops
        if hardware_flops_per_token is not None:
            row["throughput/hfu"] = tflops * hardware_flops_per_token / flops_per_token / peak_tflops
    return row

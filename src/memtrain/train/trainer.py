"""A run: the ranks meet, the run directory and the engine are set up (`Trainer.set_up`), the step loop runs
(`Trainer.fit`, `Trainer.train_step`) and the run ends (`Trainer.finish`: the last checkpoint, final/, summary.json)."""
from __future__ import annotations

import json
import os
import re
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm
import deepspeed
import deepspeed.comm as dist
import torch.distributed.distributed_c10d as c10d

from memtrain.config.args import RunArgs
from memtrain.config.ds_config import AUTO, model_hidden_size, offload_device, resolve_ds_config, tp_size, zero_stage
from memtrain.config.recipe import TrainSection
from memtrain.errors import EXIT_RUN_FAILED, RunFailed, UserError, report_here
from memtrain.model.build import build_model, decoder_layers
from memtrain.model.chat_data import PackedChat, report_line
from memtrain.model.data import RandomTokens, as_batch, blend_plan_line, prepare_data, to_device
from memtrain.model.eval_data import batches_per_rank, prepare_eval_data
from memtrain.model.freeze import freeze
from memtrain.model.lora import add_lora, trainable_patterns
from memtrain.model.zero_init import build_model_zero3
from memtrain.model.quantize import quantize_for_engine
from memtrain.recompute import partition
from memtrain.recompute.compiled import CompiledLayers, CompileWatch, compile_line
from memtrain.recompute.hooks import apply_plan, checkpoint_calls, configure_deepspeed_ac
from memtrain.recompute.meter import ActivationMeter
from memtrain.recompute.policy import ACPlan
from memtrain.train import checkpoint, ds_log, gloo_env, long_context, parallel, reshard, rng, signals
from memtrain.train import run_dir as run_dirs
from memtrain.train.checkpointer import Checkpointer, samples_per_step, save_every_s
from memtrain.train.evaluate import EvalResult, evaluate
from memtrain.train.ports import free_port
from memtrain.train.faults import RunPosition, is_oom, oom_message, write_failure
from memtrain.train.final import save_final
from memtrain.train.interval_log import IntervalLogger, eval_due, is_boundary, log_every
from memtrain.train.loss_scale import scaler_row, skipped_warning
from memtrain.train.metrics import medians
from memtrain.train.node import agent_ranks
from memtrain.train.optimizer import engine_arguments, own_sections
from memtrain.train.preflight import check_host_memory, resolve_run
from memtrain.train.run_dir import RunDir
from memtrain.recompute.meter import OpCounter
from memtrain.train.zero3_probe import Zero3Probe, summarize
from memtrain.units import GIB



def single_process_env() -> Optional[str]:
    """`python src/train.py` without a launcher: a world of one, whatever WORLD_SIZE a shell left behind (a warning
    then: without a launcher's RANK no other rank will join)."""
    if "RANK" in os.environ:
        return None
    left = os.environ.get("WORLD_SIZE", "1")
    port = free_port()
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
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 inside its guard: DeepSpeed's op table may be absent

        if get_accelerator().device_name() != "cpu":
            return
        import deepspeed.ops  # noqa: PLC0415 inside its guard: DeepSpeed's op table may be absent

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError):
        pass


def _groups_wait_as_long_as_the_world(timeout: timedelta) -> None:
    """torch's new_group takes its own default timeout (gloo 30 min, NCCL 10 min), not the world group's, and
    DeepSpeed makes its tensor-, data- and sequence-parallel groups without one: a rank waiting on a lost peer
    in one of them would outwait train.collective_timeout_s by far. Every group made from here on takes it.
    (torch reads these module globals at each new_group; there is no public setter.)"""
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def _meet(timeout: timedelta) -> None:
    """The ranks' rendezvous. A rank that stopped before it (a check that failed on its node printed its own
    line) leaves the others waiting here until train.collective_timeout_s: one line, from rank 0, not torch's
    traceback of the store's wait."""
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


def _check_the_nodes_host_memory(checked, world: int) -> None:
    """The host-memory check again, with every rank on this host counted: several launcher agents on one node (2 x 4
    ranks instead of 1 x 8) each saw only their own ranks before the ranks met. One all-gather of host names."""
    if world == 1:
        return
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    here = hosts.count(socket.gethostname())
    if here > agent_ranks(world):
        prediction = checked.memory_plan.prediction if checked.memory_plan is not None else checked.prediction
        check_host_memory(prediction, world, ranks_on_node=here, final=checked.final_bytes)


def _choose_run_dir(args: RunArgs, rank: int) -> tuple[RunDir, Optional[str]]:
    """The run directory (one timestamp for all ranks), held by rank 0 for the run (run_dir.lock): a second run on it
    is refused on every rank; a warning where its file system has no file locks."""
    chosen: list = [None]
    if rank == 0:
        path = args.run_dir or Path(f"runs/{args.recipe.name}-{datetime.now():%Y%m%d-%H%M%S}")
        chosen = [(str(path), *run_dirs.lock(path))]
    dist.broadcast_object_list(chosen, src=0)
    path, refusal, warning = chosen[0]
    if refusal:
        raise UserError(refusal)
    return RunDir(Path(path)), warning


def train(args: RunArgs) -> dict:
    """Train; a NaN/inf loss or an OOM ends it with one line and summary.json status failed/oom."""
    alone = single_process_env()  # first: validation sizes batches by this world
    if alone:
        print(f"warning: {alone}", flush=True)
    progress = RunPosition(world=int(os.environ.get("WORLD_SIZE", 1)), rank=int(os.environ.get("RANK", 0)))
    try:
        return _train_or_report(args, progress)
    except BaseException:  # --overwrite: the new run saved nothing, so the earlier run comes back
        if progress.run_dir is not None:
            run_dirs.roll_back(progress.run_dir.path)
        raise
    finally:
        if progress.run_dir is not None:
            run_dirs.unlock(progress.run_dir.path)


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
        if progress.run_dir is not None:
            run_dirs.roll_back(progress.run_dir.path)
        if progress.world == 1:
            raise RunFailed(reason) from None
        # Other ranks may wait in a collective forever: report from this rank and leave at once;
        # the launcher then stops the rest.
        report_here(reason)
        os._exit(EXIT_RUN_FAILED)


def _train(args: RunArgs, progress: RunPosition) -> dict:
    """A run in three phases: set up (checks, ranks, run directory, engine), the step loop, and the end
    (model checkpoint, final/, summary.json)."""
    trainer = Trainer.set_up(args, progress)
    trainer.fit()
    return trainer.finish()


COMPILE_WARMUP_STEPS = 2  # steps that may compile: the first forward and backward, and a graph-mode change


@dataclass
class Trainer:
    """A run segment once set up: what it trains (engine, data, AC plan), where (run directory, data layout), and
    where its loop stands. `fit()` runs the steps, `train_step()` one of them, `finish()` saves and reports."""

    args: RunArgs
    progress: RunPosition  # world, rank, run directory, step and bar: what a fault's report needs
    checked: Any  # preflight's result (memtrain.train.preflight): model config, spec, prediction, warnings
    plan: ACPlan  # the plan every rank runs (rank 0's under policy auto)
    memory_plan: Any  # policy auto's plan (memtrain.memory.planner), else None
    run_dir: RunDir
    data: Any  # the training rows: packed text, chat rows or random tokens (memtrain.model.data)
    eval_data: Any  # held-out rows (memtrain.model.eval_data), or None
    agreement: signals.StopAgreement
    engine: Any  # DeepSpeed's engine
    longctx: long_context.LongContext  # sequence parallel, tiled MLP, loss
    layout: parallel.Layout  # which batch this rank reads
    compiled: bool  # train.compile, as rank 0 decided
    # the loop's state
    start: int = 0  # the first step of this segment (a resumed run's checkpoint)
    shift: int = 0  # the data's step is the step + shift (a resume on another batch size: train/reshard.py)
    done: int = 0  # steps completed
    status: str = "completed"
    stop_signal: Optional[str] = None
    started: float = 0.0  # time.time() as the loop began
    eval_batches: int = 0  # eval micro-batches a data rank reads (0: no held-out data)
    last_eval: Optional[EvalResult] = None
    meter: ActivationMeter = field(default_factory=ActivationMeter)
    probe: Optional[Zero3Probe] = None  # train.probe
    compiles: Optional[CompileWatch] = None  # train.compile
    log: Optional[IntervalLogger] = None
    checkpointer: Optional[Checkpointer] = None

    @property
    def t(self) -> TrainSection:
        return self.args.recipe.train

    @property
    def rank(self) -> int:
        return self.progress.rank

    def prediction(self):
        """What memtrain predicted for the plan that runs (policy auto's plan came with its own)."""
        return self.memory_plan.prediction if self.memory_plan is not None else self.checked.prediction

    @classmethod
    def set_up(cls, args: RunArgs, progress: RunPosition) -> "Trainer":
        """Every check before any distributed work (the one `make train` runs first), the ranks, the run directory and
        its plan lines, the model with its AC hooks and the DeepSpeed engine."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        recipe, t, world = args.recipe, args.recipe.train, progress.world
        set_local_device()  # before validation: policy auto times this rank's own device
        checked = resolve_run(args, world)  # validate everything: the same check `make train` runs first
        data, eval_data, gloo_warning = _meet_the_ranks(recipe, args.ds_config, world, checked.config.vocab_size)
        _check_the_nodes_host_memory(checked, world)
        # a stop signal on any rank stops all within two steps; rank 0's clock decides timed saves
        agreement = signals.StopAgreement(world, save_every_s(t), progress.rank)
        plan, memory_plan, compiled = _one_plan(checked, t)
        run_dir, lock_warning = _choose_run_dir(args, progress.rank)
        progress.run_dir = run_dir
        ds_log.buffer()  # DeepSpeed's own log: off the console, to run_dir/deepspeed.log below
        ds_config = checked.zero3.apply(resolve_ds_config(args.ds_config, recipe, world, run_dir.path,
                                                          plan.checkpoint_calls, hidden_size=model_hidden_size(
                                                              checked.config), default_tensorboard=True))
        earlier: list = []  # a resumed run's earlier segments (rank 0's, for config.json)
        if progress.rank == 0:
            earlier = _prepare_run_dir(args, run_dir, ds_config, world, plan)
            warnings = checked.warnings + tuple(w for w in (lock_warning, gloo_warning) if w)
            print("\n".join(_plan_lines(args, checked, plan, memory_plan, compiled, data, agreement, world)
                            + [f"warning: {w}" for w in warnings]), flush=True)
        dist.barrier()  # the run directory is ready (an earlier run's files set aside) before any rank writes to it
        run_dirs.check_shared(run_dir.path, progress.rank)  # every node sees it (one line, on every rank, where not)
        ds_log.to_file(run_dir.path, progress.rank)
        engine, longctx, layout, number_changed = build_engine(recipe, checked.config, plan, ds_config, args.ds_config,
                                                               checked.spec, compiled=compiled.on)
        if progress.rank == 0:
            print("\n".join(longctx.lines), flush=True)
            if number_changed:  # number_checkpoints "auto": the modules matched are known now
                _write_config(run_dir, args, ds_config, world, plan, earlier)
        return cls(args, progress, checked, plan, memory_plan, run_dir, data, eval_data, agreement, engine, longctx,
                   layout, compiled.on)

    def fit(self) -> None:
        """The step loop, from a resumed step if any. Each step trains (`train_step`); at a boundary (`is_boundary`,
        a stop signal, a timed save) the interval is logged, the held-out data evaluated, and the run stops or saves."""
        t = self.t
        self._resume()
        log, saver = self._start_loop()
        deadline = signals.StopDeadline(t.stop_deadline_s, t.metric_warmup_steps)
        every = log_every(t, self.args.ds_config)
        log.begin(self.start)
        for step in range(self.start, self.start if self.stop_signal else t.max_steps):
            log.step_done(*self.train_step(step))
            self.done = step + 1
            self._report_compiles(step)
            agreed = self.agreement.step()  # signals any rank had by the end of the previous step
            if not (is_boundary(self.done, t, every) or agreed or self.agreement.save_due):
                continue
            row, stopped = log.close(self.done, agreed)  # the boundary: one all-reduce, one host read
            deadline.check(log.step_s, saver.seconds, self.rank)
            if self.eval_batches and eval_due(self.done, t) and not stopped:
                row = {**row, **self._evaluate(step)}  # a new row: the history keeps training's figures only
            log.publish(row, self.done, self.last_eval.loss if self.last_eval else None)
            if stopped:
                self.stop_signal, self.status = signals.received() or stopped[0], "preempted"  # every rank's
                break
            saver.maybe_save(self.done, self.agreement)
            log.begin(self.done)
        self.progress.bar.close()
        self.agreement.close()

    def train_step(self, step: int) -> tuple[torch.Tensor, int]:
        """One optimizer step of train.grad_accum_steps micro-batches: (the summed micro-step loss, left on the
        device: no host-device sync inside a step; the real tokens this rank read)."""
        t, layout, engine, data, sp = self.t, self.layout, self.engine, self.data, self.longctx.sp
        loss_sum, tokens = torch.zeros((), device=engine.device), 0
        # the step's labelled tokens, every rank's, from the data itself (no collective): the loss is their mean
        divisor = layout.loss_divisor(data.labelled_tokens(step + self.shift, layout.dp_size, t.micro_batch_size,
                                                           t.grad_accum_steps), t.grad_accum_steps)
        count_ops = self.probe is not None and step == self.start + 2  # one step, after ZeRO-3 recorded its trace
        with OpCounter() if count_ops else nullcontext() as ops:
            for micro in range(t.grad_accum_steps):
                batch = as_batch(data.batch(step + self.shift, micro, layout.dp_rank, layout.dp_size,
                                            t.micro_batch_size, t.grad_accum_steps))
                tokens += batch.tokens
                measure = step == self.log.start and micro == 0  # activation bytes of one forward per interval
                with self.meter.measure() if measure else nullcontext():
                    loss = engine(**sp.slice_batch(to_device(batch.inputs, engine.device)), loss_divisor=divisor).loss
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
        if self.probe:
            self.probe.step_done(engine, {"aten_ops": ops.ops} if count_ops else None)
        return loss_sum, tokens

    def _resume(self) -> None:
        """Where this segment starts: a resumed run's checkpoint (its RNG streams too; one of another world size
        through its universal copy: train/reshard.py), else step 0; a stop signal during start-up ends it here."""
        t = self.t
        rng.seed_everything(t.seed, self.layout, self.rank)  # dropout streams: one per data-parallel rank
        resumed = reshard.resume(self.engine, self.run_dir.checkpoints, samples_per_step(t, self.layout)) \
            if self.args.resume else None
        if resumed:
            self.start, self.shift = resumed.step, resumed.shift  # the data reads step + shift
            if resumed.line and self.rank == 0:
                print(resumed.line, flush=True)
        self.done = self.progress.step = self.start
        self.started = time.time()
        self.stop_signal = _stopped_in_start_up(self.engine.device, self.progress.world)
        if self.stop_signal:  # nothing trained, nothing saved: a requeue starts cleanly
            self.status = "preempted"

    def _start_loop(self) -> tuple[IntervalLogger, Checkpointer]:
        """The loop's companions: the bar, the interval logger, the checkpointer, train.probe and train.compile."""
        t, layout = self.t, self.layout
        if self.eval_data is not None:
            self.eval_batches = batches_per_rank(len(self.eval_data), t.eval_batches, layout.dp_size,
                                                 t.micro_batch_size, t.grad_accum_steps)
        bar = self.progress.bar = tqdm(total=t.max_steps, initial=self.start, disable=self.rank != 0,
                                       desc=self.args.recipe.name, unit="step", dynamic_ncols=True)
        self.log = IntervalLogger(self.engine, layout, t, self.plan, self.checked.config, self.args.recipe.data.seq_len,
                                  self.run_dir, self.progress, bar, self.meter, self.prediction().peak)
        self.checkpointer = Checkpointer(self.engine, self.run_dir, t, layout, self.shift)
        self.probe = _start_probe(self.engine) if t.probe else None
        self.compiles = CompileWatch() if self.compiled else None
        return self.log, self.checkpointer

    def _evaluate(self, step: int) -> dict[str, float]:
        """The held-out loss after `step`, outside the interval's clock; its TensorBoard tags."""
        self.last_eval = evaluate(self.engine, self.eval_data, self.longctx.sp, self.layout, self.eval_batches,
                                  self.t.micro_batch_size)
        if self.compiles is not None:  # eval's no-grad forward compiles each layer once more: expected, not late
            self.compiles.step_done(step, warmed_up=False)
        return self.last_eval.metrics()

    def _report_compiles(self, step: int) -> None:
        """train.compile: a warning for each compile after the warm-up (with dynamo's reason), and the compile line
        once the warm-up is over (the measured activations against the plan's eager prediction). Host-side
        counters: no device sync."""
        if self.compiles is None:
            return
        lines = self.compiles.step_done(step, warmed_up=self.done > self.start + COMPILE_WARMUP_STEPS)
        if self.rank != 0:
            return
        for line in lines:
            self.progress.bar.write(f"warning: {line}")
        if self.done == min(self.start + COMPILE_WARMUP_STEPS, self.t.max_steps):
            planned = getattr(self.prediction(), "saved_activations", None)
            self.progress.bar.write(compile_line(self.compiles, self.meter.bytes, planned))

    def finish(self) -> dict:
        """The last model checkpoint, final/ and summary.json, then the process group closed."""
        t, run_dir, recipe = self.t, self.run_dir, self.args.recipe
        completed = self.done if self.status == "preempted" else t.max_steps
        if t.save_checkpoints and completed > self.start:  # a stop during start-up trained nothing: nothing to save
            self.checkpointer.save(completed)
        if t.save_checkpoints and self.status == "completed":  # final/: loads with transformers' from_pretrained
            config = self.checked.config
            save_final(self.engine, self.engine.module, run_dir.final, recipe, lambda: build_model(recipe.model, config))
        summary = self.summary(completed)
        if self.rank == 0:
            checkpoint.atomic_write_text(run_dir.summary_file, json.dumps(summary, indent=2))
            run_dirs.finish_overwrite(run_dir.path)  # with train.save_checkpoints: false, nothing saved before
            self._print_end(summary["skipped_steps"], completed)
        dist.barrier()
        # Close the process group before the interpreter exits: left to interpreter shutdown, gloo's
        # threads were seen to abort a finished rank ("terminate called without an active exception").
        dist.destroy_process_group()
        return summary

    def summary(self, completed: int) -> dict:
        """summary.json: how the segment ended, its metrics' medians after the warm-up, the plan and the prediction."""
        engine, device, log = self.engine, self.engine.device, self.log
        summary = {
            "status": self.status,
            "steps": completed,
            "stop_signal": self.stop_signal,
            "final_loss": log.last_loss,
            "metrics": medians(log.history, 0),
            "measured_steps": log.measured_steps,
            "world_size": self.progress.world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "elapsed_s": time.time() - self.started,
            "ac_plan": self.plan.to_dict(),
            "run_dir": str(self.run_dir),
            "tensorboard": str(self.run_dir.tensorboard),
        }
        summary.update({k.partition("/")[2]: v for k, v in scaler_row(engine).items()})
        summary["skipped_steps"] = int(summary["skipped_steps"])
        if self.last_eval is not None:  # the last eval of this segment (a resumed run's too)
            summary.update(eval_loss=self.last_eval.loss, eval_perplexity=self.last_eval.perplexity,
                           eval_tokens=self.last_eval.tokens)
        if self.prediction().peak is not None:
            summary["predicted_peak_gib"] = self.prediction().peak / GIB
        if device.type == "cuda":
            summary["peak_allocated_gib"] = max((r["memory/peak_allocated_gib"] for r in log.history), default=0.0)
        if self.memory_plan is not None:
            summary["memory_plan"] = self.memory_plan.to_dict()
        if self.compiles is not None:
            summary["compile"] = {"compiles": self.compiles.compiles, "seconds": self.compiles.seconds(),
                                  "recompiles_after_warmup": self.compiles.late}
        if self.probe is not None:
            self.probe.__exit__(None, None, None)
            summary["probe"] = {**summarize(self.probe.steps), "per_step": self.probe.steps}
        return summary

    def _print_end(self, skipped_steps: int, completed: int) -> None:
        """Rank 0's last lines: skipped fp16 steps, and how the run ended, where its logs are and what comes next."""
        run_dir = self.run_dir
        skipped = skipped_warning(skipped_steps, completed - self.start)
        if skipped:
            print(f"warning: {skipped}", flush=True)
        if self.status == "preempted":  # stopped: the command that continues it (its inputs come from config.json)
            then = f"; continue with: --resume --run-dir {run_dir}"
        else:
            then = f"; model: {run_dir.final}" if run_dir.final.is_dir() else ""
        held_out = "" if self.last_eval is None else \
            f", eval loss {self.last_eval.loss:.4f} (perplexity {self.last_eval.perplexity:.2f})"
        print(f"{self.status}: {completed} steps, final loss {self.log.last_loss:.4f}{held_out}; "
              f"TensorBoard logs: {run_dir.tensorboard} (tensorboard --logdir {run_dir.tensorboard}){then}", flush=True)


def _meet_the_ranks(recipe, ds_config: dict, world: int, vocab_size: int) -> tuple[Any, Any, Optional[str]]:
    """Signals recorded, CPU threads shared, the data read, then the ranks' rendezvous and their groups' timeout:
    (training rows, held-out rows or None, gloo's warning or None)."""
    t = recipe.train
    signals.install()  # src/train.py did already, first thing; an in-process caller gets it here
    _share_cpu_cores(ds_config)
    _skip_shm_comm_op()
    # The corpus is packed before the rendezvous: ranks wait on the cache's file lock, not in a collective
    # that a long packing would time out (memtrain.model.data.prepare_data).
    data = RandomTokens(vocab_size, recipe.data.seq_len, t.seed) if recipe.data.random_tokens else \
        prepare_data(recipe.data, t.seed)
    eval_data = prepare_eval_data(recipe.data, t.seed)  # packed the same way, before the ranks meet
    gloo_warning = gloo_env.prepare(world)  # descriptors for gloo's sockets, an address other nodes reach
    timeout = timedelta(seconds=t.collective_timeout_s)
    _meet(timeout)
    _groups_wait_as_long_as_the_world(timeout)
    return data, eval_data, gloo_warning


def _one_plan(checked, t) -> tuple[ACPlan, Any, Any]:
    """(AC plan, policy auto's plan, compile choice) every rank runs: rank 0's.

    policy auto: every rank planned on its own device, but they must all run one plan: rank 0's. Per-rank plans could
    differ by timing noise, and a rank that recomputes less than the others would be the one to run out of memory
    first. train.compile auto: each rank read its own node's gpu-check figures; all compile, or none, as rank 0
    decided."""
    shared = [checked.plan, checked.memory_plan, checked.compile]
    if checked.memory_plan is not None or t.compile == "auto":
        dist.broadcast_object_list(shared, src=0)
    return shared[0], shared[1], shared[2]


def _prepare_run_dir(args: RunArgs, run_dir: RunDir, ds_config: dict, world: int, plan) -> list:
    """Rank 0: `--overwrite` sets the earlier run aside (deleted once this run saved a model checkpoint), the
    directory is made and config.json written. Returns a resumed run's earlier segments (config.json's history)."""
    if args.overwrite:
        run_dirs.set_aside(run_dir.path)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    earlier = _earlier_segments(run_dir) if args.resume else []
    _write_config(run_dir, args, ds_config, world, plan, earlier)
    return earlier


def _plan_lines(args: RunArgs, checked, plan, memory_plan, compiled, data, agreement, world: int) -> list[str]:
    """Rank 0's start lines: what a resume changes, the AC plan, the ZeRO-3 layout, the model, the compile choice,
    the chat packing, the blend, policy auto's plan and the timed saves."""
    recipe, t = args.recipe, args.recipe.train
    lines = []
    if args.resume_changes:  # --resume continues the run's saved inputs; what this launch changes of them
        lines.append(f"resume overrides: {'; '.join(args.resume_changes)}")
    lines += [plan.describe(), *(f"  {line}" for line in checked.zero3.lines), *checked.model_lines]
    if compiled.line:
        lines.append(compiled.line)
    if isinstance(data, PackedChat):  # what was packed, how full the rows are, what was skipped and why
        lines.append(report_line(data.report, recipe.data))
    if recipe.data.sources:  # each source's tokens, share of the rows and epochs this run takes of it
        dp = world // (tp_size(args.ds_config) * recipe.parallel.sequence)
        lines.append(blend_plan_line(data, t.max_steps * t.micro_batch_size * t.grad_accum_steps * dp))
    if memory_plan is not None:
        lines.append(memory_plan.describe())
    if agreement.save_every_s and t.save_checkpoints:  # what a requeue after a lost node resumes from
        why = "train.save_every_minutes" if t.save_every_minutes else "a Slurm job's default"
        lines.append(f"model checkpoints: every {agreement.save_every_s / 60:g} min of training ({why})"
                     + (f", every {t.save_interval} steps" if t.save_interval else "") + ", on a stop signal and at the end")
    return lines


def _stopped_in_start_up(device, world: int) -> Optional[str]:
    """A stop signal any rank got before the first step (one all-reduce, before the loop): its name, or None."""
    flags = torch.tensor(signals.one_hot(), device=device)
    if world > 1:
        dist.all_reduce(flags)
    stopped = signals.names(flags.tolist())
    if stopped and int(os.environ.get("RANK", 0)) == 0:
        print(f"preempted during start-up ({stopped[0]}): no step run, nothing saved", flush=True)
    return (signals.received() or stopped[0]) if stopped else None


def _start_probe(engine):
    """train.probe: ZeRO-3's per-step counters (memtrain.train.zero3_probe) around the training loop."""
    return Zero3Probe(engine.module, list(decoder_layers(engine.module)[1])).__enter__()


def build_engine(recipe, config, plan, ds_config: dict, raw_ds_config: dict, spec, compiled: bool = False):
    """The model (built partitioned under ZeRO-3, with transformers' own initialisation), the AC plan's
    hooks (each decoder layer compiled with `compiled`: train.compile) and the DeepSpeed engine: (engine,
    long-context set-up, data layout, whether the JSON's "auto" number_checkpoints changed now that the plan met
    the model; `ds_config` then holds the new value)."""
    rng.seed_everything(recipe.train.seed)  # the same initial weights on every rank
    stage = zero_stage(ds_config)
    quantization = recipe.model.quantization
    if stage == 3 and quantization is None:  # built partitioned, with transformers' own initialisation
        model = build_model_zero3(recipe.model, config, ds_config)
    else:  # a 4-bit base is built whole, then quantized; deepspeed.initialize partitions it (as transformers does)
        model = build_model(recipe.model, config)
    if quantization is not None:
        quantize_for_engine(model, quantization, ds_config)
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


def _write_config(run_dir: RunDir, args: RunArgs, ds_config: dict, world: int, plan, earlier: list) -> None:
    """config.json: the recipe and the resolved DeepSpeed JSON (every "auto" filled) this run segment uses, the JSON
    as written (what a `--resume` continues with: memtrain.config.saved_run), and each earlier segment's record."""
    record = {"recipe": args.recipe.model_dump(), "deepspeed": ds_config, "deepspeed_path": args.ds_config_path,
              "deepspeed_as_written": args.ds_config, "world_size": world, "ac_plan": plan.to_dict()}
    record.update(own_sections(ds_config, args.recipe))  # what memtrain builds for missing sections
    if args.resume:
        record["resume_changes"] = list(args.resume_changes)
    record["earlier_segments"] = earlier
    checkpoint.atomic_write_text(run_dir.config_file, json.dumps(record, indent=2))


def _earlier_segments(run_dir: RunDir) -> list:
    """A resumed run's config.json records, oldest first, before this segment's replaces it (a damaged one is none)."""
    try:
        record = json.loads(run_dir.config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict):
        return []
    earlier = record.pop("earlier_segments", [])
    return (earlier if isinstance(earlier, list) else []) + [record]

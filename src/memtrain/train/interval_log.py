"""The training loop's log interval: its steps' losses kept on the device, and at its boundary one all-reduce (the
losses, the stop flags, the real tokens read), one host read, the NaN check, the metrics row (means over its
steps; no throughput during the metric warm-up), TensorBoard and the progress bar."""
from __future__ import annotations

import math
from typing import Optional

import torch
import deepspeed.comm as dist

from memtrain.errors import RunFailed
from memtrain.memory.flops import device_peak_tflops, model_flops_per_token, recompute_flops_per_token
from memtrain.train import signals
from memtrain.train.faults import RunPosition, nonfinite_loss_message
from memtrain.train.loss_scale import scaler_row
from memtrain.train.metrics import IntervalTimer, device_memory, host_rss_gib, reset_device_peak
from memtrain.units import GIB


def log_every(train, raw_ds_config: dict) -> int:
    """train.log_every, else the JSON's steps_per_print, else 10."""
    return int(train.log_every or raw_ds_config.get("steps_per_print") or 10)


def eval_due(done: int, t) -> bool:
    """Steps after which the held-out data is evaluated (when there is some): every train.eval_every, and the last."""
    return done == t.max_steps or bool(t.eval_every and done % t.eval_every == 0)


def is_boundary(done: int, t, every: int) -> bool:
    """Steps after which the ranks synchronise: log, the end of the metric warm-up, a save, the last.
    A pure function of the step, so every rank stops at the same ones."""
    return (done % every == 0 or done == t.max_steps or done == t.metric_warmup_steps
            or bool(t.save_interval and done % t.save_interval == 0) or eval_due(done, t))


def recompute_flops(config, seq_len: int, plan) -> Optional[float]:
    """FLOPs per token the plan's recompute adds (memtrain.memory.flops' model of torch's checkpoint); None
    where that model has no answer (module-pattern plans)."""
    if plan.modules:
        return None
    try:
        return recompute_flops_per_token(config, seq_len, tuple(plan.layers))
    except ValueError:
        return None


class IntervalLogger:
    """One log interval at a time, from `begin` to `close`. No host-device sync inside it: each step's loss stays on
    the device (`step_done`) until the boundary. Every rank calls every method (`close` holds a collective); only
    rank 0's bar shows."""

    def __init__(self, engine, layout, train, plan, config, seq_len: int, run_dir, progress: RunPosition, bar,
                 meter, predicted_peak: Optional[int]) -> None:
        self.engine, self.layout, self.train, self.plan, self.run_dir = engine, layout, train, plan, run_dir
        self.progress, self.bar, self.meter, self.predicted_peak = progress, bar, meter, predicted_peak
        self.flops_per_token = model_flops_per_token(config, seq_len)
        recompute = recompute_flops(config, seq_len, plan)
        self.hardware_flops_per_token = None if recompute is None else self.flops_per_token + recompute
        self.peak_tflops = train.peak_tflops or device_peak_tflops()
        self.timer = IntervalTimer(engine.device)
        self.start = progress.step  # the interval's first step
        self.step_losses: list[torch.Tensor] = []
        self.tokens = 0  # real tokens this rank read in the interval
        self.history: list[dict[str, float]] = []  # the rows after the metric warm-up (summary.json's medians)
        self.measured_steps = 0
        self.last_loss = float("nan")
        self.step_s = 0.0  # the last interval's seconds a step

    def begin(self, step: int) -> None:
        """An interval starts at `step`: device memory peaks and the clock start again."""
        self.start = step
        reset_device_peak()
        self.timer.start()

    def step_done(self, loss_sum: torch.Tensor, tokens: int) -> None:
        """A step trained: its summed micro-step loss (on the device) and the real tokens this rank read."""
        self.step_losses.append(loss_sum)
        self.tokens += tokens
        self.bar.update(1)

    def close(self, done: int, agreed: list[str]) -> tuple[dict[str, float], list[str]]:
        """The boundary after step `done`: (the interval's metrics row, the stop signals any rank had). One
        all-reduce and one host read; a non-finite loss stops the run before anything saves it."""
        t, layout, world, device = self.train, self.layout, self.progress.world, self.engine.device
        seconds = self.timer.stop()
        # each rank of a TP/SP group read the same batch: dp_size / world of each rank's tokens counts
        counted = [self.tokens * layout.dp_size / world]
        stats = torch.cat([torch.stack(self.step_losses), torch.tensor(signals.one_hot() + counted, device=device)])
        dist.all_reduce(stats)  # every tensor that meets a collective lives on the engine's device
        values = stats.tolist()
        # each replica's micro-step losses sum to its tokens' share of the step's token mean, times
        # grad_accum * dp_size (Layout.loss_divisor); every rank of a TP/SP group holds its replica's value
        losses = [v / (world * t.grad_accum_steps) for v in values[:len(self.step_losses)]]
        stopped = agreed or signals.names(values[len(self.step_losses):-1])
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        if bad is not None:  # stop before anything saves it; the last checkpoint stays good
            self.progress.step = self.start + bad
            raise RunFailed(nonfinite_loss_message(losses[bad], self.start + bad + 1, t.max_steps, self.run_dir, t))
        self.last_loss = losses[-1]
        self.progress.step = done
        steps = done - self.start
        self.step_s = seconds / steps
        self.step_losses, self.tokens = [], 0
        return self._warmup_filtered(self._row(sum(losses) / steps, values[-1] / steps), steps), stopped

    def _row(self, loss: float, tokens_per_step: float) -> dict[str, float]:
        """One TensorBoard point per log interval: means over its steps, peaks over its steps."""
        t, layout, world, step_s = self.train, self.layout, self.progress.world, self.step_s
        allocated, reserved = device_memory()
        tflops = self.flops_per_token * tokens_per_step / world / step_s / 1e12
        row = {
            "train/loss": loss,
            "train/lr": float(self.engine.get_lr()[0]),
            "throughput/tokens_per_s": tokens_per_step / step_s,
            "throughput/samples_per_s": layout.dp_size * t.micro_batch_size * t.grad_accum_steps / step_s,
            "throughput/tflops_per_device": tflops,
            "time/step_s": step_s,
            "memory/peak_allocated_gib": allocated,
            "memory/peak_reserved_gib": reserved,
            "memory/activation_gib": self.meter.bytes / GIB,
            "memory/host_rss_gib": host_rss_gib(),
        }
        if self.peak_tflops:  # MFU: model FLOPs only; HFU: with what the AC plan recomputes
            row["throughput/mfu"] = tflops / self.peak_tflops
            if self.hardware_flops_per_token is not None:
                row["throughput/hfu"] = tflops * self.hardware_flops_per_token / self.flops_per_token / self.peak_tflops
        row.update(scaler_row(self.engine))
        if self.predicted_peak is not None:  # memtrain's prediction, beside the measured figures
            row["memory/predicted_peak_gib"] = self.predicted_peak / GIB
        if self.plan.memtrain_offload:  # host bytes that memtrain's cpu_checkpointing took off the device
            row["memory/offloaded_activation_gib"] = self.meter.offloaded_bytes / GIB
        return row

    def _warmup_filtered(self, row: dict[str, float], steps: int) -> dict[str, float]:
        """After the metric warm-up the row joins the history; during it, loss, lr and memory only."""
        t = self.train
        if self.start >= t.metric_warmup_steps or t.max_steps <= t.metric_warmup_steps:
            self.history.append(row)
            self.measured_steps += steps
            return row
        return {k: v for k, v in row.items() if not k.startswith(("throughput/", "time/"))}

    def publish(self, row: dict[str, float], done: int, eval_loss: Optional[float]) -> None:
        """The row into TensorBoard at step `done`; the bar shows the loss, tokens/s and the last eval loss."""
        self.engine.monitor.write_events([(tag, value, done) for tag, value in row.items()])
        shown = {"loss": f"{self.last_loss:.3f}"}
        if "throughput/tokens_per_s" in row:  # measured only after the warm-up: no made-up 0 before it
            shown["tok_s"] = f"{row['throughput/tokens_per_s']:,.0f}"
        if eval_loss is not None:
            shown["eval"] = f"{eval_loss:.3f}"
        self.bar.set_postfix(**shown, act_gib=f"{row['memory/activation_gib']:.3f}")

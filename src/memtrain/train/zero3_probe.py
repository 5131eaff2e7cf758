"""Counters for ZeRO-3's per-step host work: parameter fetches by layer and phase, all-gathers, and the state DeepSpeed keeps.

`Zero3Probe(model)` wraps DeepSpeed 0.19.8's `PartitionedParameterCoordinator.fetch_sub_module` (every
ZeRO-3 module hook that gathers parameters goes through it) and the communication backend's
all-gather function, and sorts each call into a phase:

* ``forward``: outside any backward;
* ``recompute``: inside a backward, while a checkpointed function runs again
  (`memtrain.recompute.hooks.observe_recompute` marks every checkpointed run);
* ``backward``: inside a backward, outside a recompute.

`step_done(engine)` closes one optimizer step: it records the step's counts, the length of
DeepSpeed's `FWD_MODULE_STACK` (pushed by every pre-forward hook, popped by every post-forward
hook: a hook pair broken inside a recompute makes it grow), whether the coordinator's trace is
complete, the process's CPU time, and what the caller adds (the trainer: aten ops of one step).

Used by `train.probe: true` (figures in `summary.json`) and `make bench-host`. The counters are
read from DeepSpeed's own objects, not from memtrain's hooks, so a test built on them is an
independent check of what memtrain installs.
"""
from __future__ import annotations

import collections
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from memtrain.recompute.hooks import observe_recompute

PHASES = ("forward", "recompute", "backward")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Zero3Probe:
    """Per-step counters of ZeRO-3's hooks and collectives; see the module docstring."""

    def __init__(self, model: torch.nn.Module, layers: Optional[list] = None) -> None:
        # module -> index of the decoder layer that contains it (None: outside every layer)
        self._layer_of: dict[int, Optional[int]] = {}
        for index, layer in enumerate(layers or []):
            for module in layer.modules():
                self._layer_of[id(module)] = index
        self.num_layers = len(layers or [])
        self._recompute_depth = 0
        self._restore: list[Callable[[], None]] = []
        self.steps: list[dict] = []
        self._reset()

    # ------------------------------------------------------------------ counting
    def _reset(self) -> None:
        self.fetches = {p: 0 for p in PHASES}
        self.layer_fetches = {p: collections.Counter() for p in PHASES}
        self.all_gathers = 0
        self.all_gather_bytes = 0
        self._started = time.process_time()

    def _phase(self) -> str:
        if not _in_backward():
            return "forward"
        return "recompute" if self._recompute_depth else "backward"

    @contextmanager
    def _observer(self):
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1

    def __enter__(self) -> "Zero3Probe":
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        original_fetch = PartitionedParameterCoordinator.fetch_sub_module
        probe = self

        def fetch_sub_module(coordinator, current_submodule, forward):
            phase = probe._phase()
            probe.fetches[phase] += 1
            layer = probe._layer_of.get(id(current_submodule))
            if layer is not None:
                probe.layer_fetches[phase][layer] += 1
            return original_fetch(coordinator, current_submodule, forward)

        PartitionedParameterCoordinator.fetch_sub_module = fetch_sub_module
        self._restore.append(lambda: setattr(PartitionedParameterCoordinator, "fetch_sub_module", original_fetch))

        import deepspeed.comm.comm as ds_comm  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        backend = ds_comm.cdb
        original_gather = getattr(backend, "all_gather_function", None)
        if original_gather is not None:
            def all_gather(*args, **kwargs):
                out = kwargs.get("output_tensor", args[0] if args else None)
                probe.all_gathers += 1
                if isinstance(out, torch.Tensor):
                    probe.all_gather_bytes += out.numel() * out.element_size()
                return original_gather(*args, **kwargs)

            backend.all_gather_function = all_gather
            self._restore.append(lambda: setattr(backend, "all_gather_function", original_gather))
        self._observe = observe_recompute(self._observer)
        self._observe.__enter__()
        self._restore.append(lambda: self._observe.__exit__(None, None, None))
        return self

    def __exit__(self, *exc) -> None:
        while self._restore:
            self._restore.pop()()

    # ------------------------------------------------------------------ one step
    def step_done(self, engine, extra: Optional[dict] = None) -> dict:
        """Record the step that just ended (after `engine.step()`) and start counting the next."""
        from deepspeed.runtime.zero import parameter_offload  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        coordinator = None
        optimizer = getattr(engine, "optimizer", None)
        offload = getattr(optimizer, "parameter_offload", None)
        if offload is not None:
            coordinator = offload.get_param_coordinator()
        row = {
            "fetches": dict(self.fetches),
            "fetches_per_layer": {p: [self.layer_fetches[p][i] for i in range(self.num_layers)] for p in PHASES},
            "all_gathers": self.all_gathers,
            "all_gather_bytes": self.all_gather_bytes,
            "fwd_module_stack": len(parameter_offload.FWD_MODULE_STACK),
            "trace_complete": bool(coordinator is not None and coordinator.is_complete_trace()),
            "cpu_s": time.process_time() - self._started,
        }
        if extra:
            row.update(extra)
        self.steps.append(row)
        self._reset()
        return row


def summarize(steps: list[dict], skip: int = 2) -> dict:
    """The steady state of a probe's steps: medians from step `skip` on, and whether the state stayed flat."""
    steady = steps[skip:] or steps
    if not steady:
        return {}

    def median(values):
        values = sorted(values)
        return values[len(values) // 2]

    out = {
        "steps": len(steps),
        "fetches": {p: median([s["fetches"][p] for s in steady]) for p in PHASES},
        "all_gathers": median([s["all_gathers"] for s in steady]),
        "all_gather_bytes": median([s["all_gather_bytes"] for s in steady]),
        # CPU time of the steps without the op counter (its dispatch mode costs host time itself)
        "cpu_s": median([s["cpu_s"] for s in steady if "aten_ops" not in s] or [s["cpu_s"] for s in steady]),
        "fwd_module_stack": [s["fwd_module_stack"] for s in steps],
        "trace_complete": [s["trace_complete"] for s in steps],
    }
    counted = [s["aten_ops"] for s in steps if "aten_ops" in s]
    if counted:  # counted on one step only
        out["aten_ops"] = counted[-1]
    return out

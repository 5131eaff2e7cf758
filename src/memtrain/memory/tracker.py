"""Live activation bytes, counted through saved-tensor hooks: the one activation tracker."""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterable, Optional

import torch
from torch import nn

GIB = float(1 << 30)

_ACTIVE_METER: Optional["ActivationMeter"] = None


def current_activation_meter() -> Optional["ActivationMeter"]:
    return _ACTIVE_METER


def _is_parameter(t: torch.Tensor) -> bool:
    """Parameters and views of them (linear saves `weight.t()`) are weights, not activations."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationMeter:
    """Bytes saved for backward and still alive at the end of the forward.

    Every tensor autograd saves goes through `saved_tensors_hooks`; parameters (and views of
    them) are not activations and are skipped. Storages are counted once (views share them), and sizes
    are read at the end of the forward, so checkpoints that were offloaded or freed in the
    meantime count as what they really hold. Torch's non-reentrant checkpoint keeps its
    inputs through a closure rather than autograd, so it reports them with `retain`.

    `offloaded_bytes` counts what memtrain's offload (`memtrain.recompute.offload`) moved to host memory
    during the forward; those tensors no longer count in `bytes`. On CPU both are host memory.
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self.bytes = 0
        self.offloaded_bytes = 0
        self._offloaded = 0

    def offloaded(self, nbytes: int) -> None:
        self._offloaded += nbytes

    def retain(self, tensors: Iterable) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and not _is_parameter(t):
                self._refs.append(weakref.ref(t))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            self._refs.append(weakref.ref(t))
        return t

    @contextmanager
    def measure(self):
        global _ACTIVE_METER
        self._refs.clear()
        self._offloaded = 0
        previous, _ACTIVE_METER = _ACTIVE_METER, self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _ACTIVE_METER = previous
            self.bytes = self._alive_bytes()
            self.offloaded_bytes = self._offloaded
            self._refs.clear()

    def _alive_bytes(self) -> int:
        storages: dict[tuple, int] = {}
        for ref in self._refs:
            t = ref()
            if t is None:
                continue
            s = t.untyped_storage()
            if s.nbytes():
                storages[(t.device, s.data_ptr())] = s.nbytes()
        return sum(storages.values())



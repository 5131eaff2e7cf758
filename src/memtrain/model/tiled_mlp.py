"""`activation_checkpointing.tiled_mlp: N | auto`: each decoder layer's MLP runs through DeepSpeed's
`TiledMLP`, N slices of the sequence at a time, so its (tokens x intermediate) activations exist for
one slice only, in the forward and in the backward (which recomputes the slice).

Built on `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP` (ALST). Its `compute_params` are
the MLP's parameters: DeepSpeed then marks their gradients not ready until the last slice, so ZeRO
reduces each gradient once and not once per slice.

The MLP keeps its class's name, parameters and state-dict keys: only its class is swapped for a
subclass whose `forward` tiles (so memtrain's recompute hooks, which call `type(module).forward`,
recompute the tiled forward too).
"""
from __future__ import annotations

import math
from typing import Union

from torch import nn

from memtrain.errors import UserError


def tiled_mlp_shards(setting: Union[int, str, None], seq_len: int, hidden: int) -> int:
    """Slices per MLP call; `auto` is ceil(sequence / hidden) (DeepSpeed's tutorial). `seq_len` is
    the tokens one rank holds (the sequence over the sequence-parallel size). 0/None/1: untiled."""
    if setting in (None, 0):
        return 1
    if setting == "auto":
        return max(1, math.ceil(seq_len / hidden))
    return int(setting)


def _tiled_class(cls: type, shards: int) -> type:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    def plain(module, x):
        return cls.forward(module, x)

    def forward(self, x):
        # One fixed slice count on every rank (it comes from the fixed sequence length), so ZeRO-3's
        # gathers inside the slices pair up without the tutorial's all-reduce (a host sync per layer).
        return TiledMLP.apply(plain, self, x, shards, [p for p in self.parameters() if p.requires_grad])

    return type(cls.__name__, (cls,), {"forward": forward, "_memtrain_tiled_shards": shards,
                                       "__module__": cls.__module__})


def install_tiled_mlp(layers: nn.ModuleList, shards: int) -> int:
    """Tile the `mlp` of every decoder layer; returns how many were tiled."""
    if shards <= 1:
        return 0
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise UserError(f"activation_checkpointing.tiled_mlp: decoder layer {i} "
                            f"({type(layer).__name__}) has no `mlp` module to tile")
        base = type(mlp)
        base = getattr(base, "_memtrain_base", base)
        tiled = _tiled_class(base, shards)
        tiled._memtrain_base = base
        mlp.__class__ = tiled
    return len(layers)

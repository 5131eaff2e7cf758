"""`activation_checkpointing.tiled_mlp: N | auto`: each decoder layer's MLP runs through DeepSpeed's
`TiledMLP`, N slices of its tokens at a time, so its (tokens x intermediate) activations exist for
one slice only, in the forward and in the backward (which recomputes the slice).

Built on `deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP` (ALST). Its `compute_params` are
the MLP's parameters: DeepSpeed then marks their gradients not ready until the last slice, so ZeRO
reduces each gradient once and not once per slice.

The MLP keeps its class's name, parameters and state-dict keys: only its class is swapped for a
subclass whose `forward` tiles (so memtrain's recompute hooks, which call `type(module).forward`,
recompute the tiled forward too).

What memtrain adds to DeepSpeed's class: the tokens go in as one row (slices of a batch would not be contiguous);
the backward recomputes the slices from the random state the forward started from, as torch.utils.checkpoint does,
so an MLP that ends in dropout (GPT-2's) is trained on the masks its forward applied; under train.compile the tiled
MLP runs eager, outside the compiled graph, for the same reason; and the backward runs wherever the MLP's parameters
train, also where its input needs no gradient (LoRA adapters of the first layer's MLP).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Union

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from memtrain.errors import UserError


def tiled_mlp_shards(setting: Union[int, str, None], seq_len: int, hidden: int) -> int:
    """Slices per MLP call; `auto` is ceil(sequence / hidden) (DeepSpeed's tutorial). `seq_len` is
    the tokens one rank holds (the sequence over the sequence-parallel size). 0/None/1: untiled."""
    if setting in (None, 0):
        return 1
    if setting == "auto":
        return max(1, math.ceil(seq_len / hidden))
    return int(setting)


@lru_cache(maxsize=1)
def _tiled_mlp_function() -> type:
    """DeepSpeed's TiledMLP whose backward recomputes every slice with the random state of its forward.

    DeepSpeed's backward reruns the slices with whatever state the generator has then, so dropout inside the MLP
    draws other masks than the forward applied: GPT-2's MLP gradients were 15% off a finite difference of its
    loss (2026-11-27). The slices run in the same order and shapes in both passes, so the forward's starting
    state replays its masks; the state outside is restored afterwards (torch.random.fork_rng)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    class SameMasksTiledMLP(TiledMLP):
        @staticmethod
        def forward(ctx, fn, module, x, shards, compute_params, trains):
            # `trains`: an empty tensor that needs a gradient where the MLP has parameters that train. Autograd does not
            # see the parameters in DeepSpeed's list, so where the MLP's input needs no gradient (the first layer's
            # under LoRA or frozen weights) the output needed none, the backward never ran and the MLP's adapters
            # never trained. (The parameters themselves cannot be inputs: ZeRO-3's are empty until their module runs.)
            ctx.cpu_state = torch.get_rng_state()
            ctx.devices, ctx.device_states = get_device_states(x)  # none for a CPU tensor
            ctx.device_type = x.device.type
            return TiledMLP.forward(ctx, fn, module, x, shards, compute_params)

        @staticmethod
        def backward(ctx, *grads):
            with torch.random.fork_rng(devices=ctx.devices, device_type=ctx.device_type):
                torch.set_rng_state(ctx.cpu_state)
                set_device_states(ctx.devices, ctx.device_states, device_type=ctx.device_type)
                x_grad = TiledMLP.backward(ctx, *grads)[2]
            # the parameters' gradients accumulated in the slices' own backward
            return None, None, x_grad if ctx.needs_input_grad[2] else None, None, None, None

    return SameMasksTiledMLP


def _tiled_class(cls: type, shards: int) -> type:
    tiled_mlp = _tiled_mlp_function()

    def plain(module, x):
        # DeepSpeed's backward hands (tokens, hidden) slices; MoE blocks read (batch, seq, hidden)
        return cls.forward(module, x[None])[0] if x.dim() == 2 else cls.forward(module, x)

    def forward(self, x):
        # One fixed slice count on every rank (it comes from the fixed sequence length), so ZeRO-3's
        # gathers inside the slices pair up without the tutorial's all-reduce (a host sync per layer).
        # The tokens go in as one row: DeepSpeed slices dim -2, and slices of a (batch > 1, seq, hidden) input
        # are not contiguous, which MLPs that flatten with .view refuse (GPT-2's Conv1D, Mixtral's and
        # Qwen-MoE's experts). An MLP works per token, so one row of batch x seq tokens gives the same result
        # in slices of the same size; the reshape is a view of the contiguous hidden states.
        row = x.reshape(1, -1, x.shape[-1])
        params = [p for p in self.parameters() if p.requires_grad]
        trains = row.new_empty(0).requires_grad_() if params else None
        out = tiled_mlp.apply(plain, self, row, shards, params, trains)
        return out.view(x.shape)

    # Outside torch.compile's graphs (train.compile: a graph break at the MLP, which runs eager): inductor draws its
    # own random numbers, so a traced tiled backward recomputed GPT-2's MLP dropout with new masks (34% off a finite
    # difference of the loss, 2026-11-27); eager, the backward above replays the forward's.
    forward = torch.compiler.disable(forward, recursive=True)
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

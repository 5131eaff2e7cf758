"""The run's random streams: which rank draws which dropout masks, under tensor parallelism (AutoTP) too.

The ranks of a tensor-parallel group hold the same residual stream, embeddings and hidden states (replicated), and
each holds its own shard of the attention heads. Megatron's rule (its model-parallel RNG tracker): a dropout on a
replicated tensor draws the same mask on every rank of the group, one on a sharded tensor its own mask per rank.

* `seed_everything(seed, layout, rank)` seeds Python, NumPy and torch's generators by data-parallel rank under
  tensor parallelism (by global rank otherwise: data- and sequence-parallel ranks hold different tokens), so the
  ranks of a TP group draw the same residual, hidden and embedding masks: the model one process would train.
* `install` forks the generator around each attention sublayer whose probabilities drop out (attention_dropout
  > 0; the heads are sharded): inside, the device's generator is seeded from one draw of torch's CPU generator
  plus the TP rank, and restored on the way out (the replicated stream goes on alike on every rank). The draw
  comes from the CPU generator, which every recompute (torch's checkpoint and DeepSpeed's) stashes and restores,
  so a recomputed sublayer draws the same masks; and there is no state of its own, so the per-rank RNG files of
  a model checkpoint restore it. No host-device sync: the draw is a CPU tensor, and a CUDA generator's state is
  its seed and offset, on the host.
* `check` refuses, before any worker, a dropout it cannot place: one on the MLP's sharded inner width (OPT's
  activation_dropout), and one on the attention sublayer's replicated output inside that sublayer (Starcoder2's
  residual_dropout) where its probabilities drop out too (the fork would give it per-rank masks).

DeepSpeed's `checkpointing.model_parallel_cuda_manual_seed` / `get_cuda_rng_tracker` keep a stream of their own:
DeepSpeed's checkpoint replays it, torch's (memtrain's torch backend) does not, and a model checkpoint would have
to save it. Hence the fork derived from the default generator.
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from torch import nn

from memtrain.errors import UserError
from memtrain.model.build import decoder_layers
from memtrain.recompute.units import find_sublayer

PROB_KEYS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")  # config keys: attention probs
PROB_ATTRS = ("attention_dropout", "attn_dropout", "dropout")  # the sublayer's own name for it (OPT: dropout)
SHARDED_KEYS = ("activation_dropout",)  # on the MLP's inner width, which AutoTP shards


def seed_everything(seed: int, layout=None, rank: int = 0) -> None:
    """Seed Python, NumPy and torch (CPU and devices): `seed` plus 1000 x the rank whose masks this process draws
    (`stream_rank`); without a layout, `seed` itself (every rank alike: the model's initialisation)."""
    seed += 1000 * stream_rank(layout, rank) if layout is not None else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stream_rank(layout, rank: int) -> int:
    """The data-parallel rank under tensor parallelism (a TP group shares one stream), else the global rank."""
    return layout.dp_rank if layout.tp > 1 else rank


def attention_dropout(config) -> float:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((float(getattr(text, k)) for k in PROB_KEYS if isinstance(getattr(text, k, None), (int, float))), 0.0)


def check(config, model: nn.Module, tp: int, source: str) -> None:
    """Under AutoTP: one line for a dropout whose masks cannot be placed (the module's docstring). `model` may be on
    the meta device."""
    if tp <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in SHARDED_KEYS:
        if float(getattr(text, key, 0) or 0) > 0:
            raise UserError(f"{source}: tensor_parallel.autotp_size: the model's {key} "
                            f"({getattr(text, key)}) drops out the MLP's inner width, which AutoTP shards, and "
                            f"memtrain draws per-rank masks only around attention; set model.config.{key}=0 or "
                            "autotp_size 1")
    if attention_dropout(config) <= 0:
        return
    layer = decoder_layers(model)[1][0]
    attn = find_sublayer(layer, "attn")
    if attn is None:
        raise UserError(f"{source}: tensor_parallel.autotp_size: {type(layer).__name__} has no attention sublayer by "
                        "a known name, around which the sharded heads' dropout would draw per-rank masks; set "
                        "model.config.attention_dropout=0 or autotp_size 1")
    others = _other_dropouts(attn)
    if others:
        raise UserError(f"{source}: tensor_parallel.autotp_size: {type(attn).__name__} drops out its replicated "
                        f"output ({others[0]}) as well as its sharded heads' probabilities (attention_dropout "
                        f"{attention_dropout(config)}); the two need different masks per rank: set one of them to 0 "
                        "or autotp_size 1")


def _other_dropouts(attn: nn.Module) -> list[str]:
    """Dropout probabilities > 0 the attention sublayer holds besides its probabilities' (attribute names)."""
    found = [name for name, value in vars(attn).items()
             if "dropout" in name and name not in PROB_ATTRS and isinstance(value, float) and value > 0]
    found += [name for name, child in attn.named_children()
              if isinstance(child, nn.Dropout) and child.p > 0 and name not in PROB_ATTRS]
    return found


class ShardedFork:
    """Forward hooks of one attention sublayer: a forked generator inside it, seeded per TP rank."""

    def __init__(self, tp_rank: int, device: torch.device) -> None:
        self.tp_rank = tp_rank
        self.generator = (torch.cuda.default_generators[device.index if device.index is not None
                                                        else torch.cuda.current_device()]
                          if device.type == "cuda" else torch.default_generator)
        self.saved: list[Optional[torch.Tensor]] = []  # a stack: a sublayer may be entered again in a recompute

    def enter(self, module: nn.Module, args) -> None:
        if not module.training:
            self.saved.append(None)
            return
        seed = int(torch.randint(0, 2**62, (), generator=torch.default_generator))  # CPU: replayed by recompute
        self.saved.append(self.generator.get_state())
        self.generator.manual_seed(seed + self.tp_rank)

    def leave(self, module: nn.Module, args, output) -> None:
        state = self.saved.pop()
        if state is not None:
            self.generator.set_state(state)


def install(model: nn.Module, config, layout, device: torch.device) -> int:
    """Fork the generator around every attention sublayer whose probabilities drop out, under tensor parallelism;
    returns how many (0: nothing drops out on a sharded tensor). After `deepspeed.initialize` (the layout)."""
    if layout.tp <= 1 or attention_dropout(config) <= 0:
        return 0
    installed = 0
    for layer in decoder_layers(model)[1]:
        attn = find_sublayer(layer, "attn")
        fork = ShardedFork(layout.tp_rank, device)
        attn.register_forward_pre_hook(fork.enter)
        attn.register_forward_hook(fork.leave)
        installed += 1
    return installed


def forks(model: nn.Module) -> int:
    """How many sublayers of `model` fork the generator (`install`)."""
    return sum(isinstance(getattr(hook, "__self__", None), ShardedFork)
               for m in model.modules() for hook in m._forward_pre_hooks.values())

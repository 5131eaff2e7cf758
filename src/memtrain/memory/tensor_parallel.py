"""What tensor parallelism (DeepSpeed AutoTP) and partitioned activation checkpoints change in the memory
model: one rank's model is the model with its attention heads, KV heads and MLP width divided by the TP
size (AutoTP's column/row-parallel shards; hidden size, norms and embeddings stay whole), its LM head
weight is sharded too (its logits are gathered whole), ZeRO shards over the data-parallel ranks only,
and a partitioned checkpoint keeps 1/tp of its input until its recompute gathers it back."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

from memtrain.recompute.policy import ATTN, FULL, MLP

# config keys AutoTP's shards divide; head_dim is pinned so dividing the heads keeps its value
_HEADS = ("num_attention_heads", "num_key_value_heads")


def supports(config) -> bool:
    """Whether the local-shard model can be built from this config family (Llama-like keys)."""
    return all(isinstance(getattr(config, k, None), int) for k in (*_HEADS, "intermediate_size", "hidden_size")) \
        and "head_dim" in config.to_dict()


def local_config(config, tp: int):
    """The config of one TP rank's shard: heads, KV heads and MLP width divided, head_dim kept."""
    if tp <= 1 or not supports(config):
        return config
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for key in (*_HEADS, "intermediate_size"):
        setattr(local, key, getattr(config, key) // tp)
    return local


def shard_lm_head(profile, config, tp: int):
    """AutoTP shards an untied LM head's weight by vocabulary rows (its output is gathered whole); rank 0
    holds the larger share of an uneven split (measured: 129 of 257 rows at TP=2)."""
    if tp <= 1 or getattr(config, "tie_word_embeddings", False) or not supports(config):
        return profile
    full = config.vocab_size * config.hidden_size
    shard = -(-config.vocab_size // tp) * config.hidden_size  # uneven vocabularies: the largest rank's rows
    sizes = dict(profile.param_sizes)
    if sizes.get(full, 0) < 1:
        return profile
    sizes[full] -= 1
    sizes[shard] = sizes.get(shard, 0) + 1
    return replace(profile, num_params=profile.num_params - full + shard,
                   param_sizes=tuple(sorted((k, v) for k, v in sizes.items() if v)))


def mark_replicated(profile, config, tp: int):
    """The profile with the elements AutoTP leaves whole on every TP rank: the input embedding and every
    hidden-sized weight (the norms), and a tied LM head (it stays with the embedding). Call after
    `shard_lm_head`: an untied head is sharded, so it is not among them."""
    if tp <= 1 or not supports(config):
        return profile
    embedding = config.vocab_size * config.hidden_size
    norms = sum(count for numel, count in profile.param_sizes if numel == config.hidden_size)
    layer_params = tuple((numel, numel == config.hidden_size) for numel, _ in profile.layer_params)
    return replace(profile, replicated=embedding + norms * config.hidden_size, layer_params=layer_params)


def partition_inputs(profile, tp: int):
    """DeepSpeed keeps 1/tp of each checkpointed input (full layers, attention or MLP sublayers) on a
    rank; the recompute gathers the whole input back for its backward."""
    if tp <= 1:
        return profile
    layers = dict(profile.layers)
    for mode in (FULL, ATTN, MLP):
        if mode in layers:
            c = layers[mode]
            moved = c.input_bytes - c.input_bytes // tp
            layers[mode] = replace(c, saved=c.saved - moved, resident=c.resident - moved,
                                   bwd_excess=c.bwd_excess + moved)
    return replace(profile, layers=layers)


def note(config, tp: int) -> Optional[str]:
    """What the prediction leaves out for this family under TP (never silently)."""
    if tp > 1 and not supports(config):
        return (f"tensor parallelism not modelled for model type '{config.model_type}' (no head_dim/intermediate_size "
                "keys): predicted as one unsharded model per rank")
    return None

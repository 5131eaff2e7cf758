"""What Ulysses sequence parallelism adds to one rank's activation profile: the all-to-all buffers.

The profile of an SP rank is measured on its slice of the tokens with all heads (the same bytes as
Ulysses' whole sequence on heads / sp: memtrain.memory.profile). Not measured there: the exchange
itself. Each attention sends q, k and v through an all-to-all in its forward (and the output back),
and their gradients in the backward; while one runs, its input, DeepSpeed's contiguous staging copy
of it and its output are alive together. Counted here as two extra copies of q, k and v (K/V heads
repeated up to the SP degree where they are fewer) in every layer's forward and backward transient.
An estimate from the algorithm, not measured on an allocator.
"""
from __future__ import annotations

from dataclasses import replace

_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}


def exchange_bytes(config, tokens: int, sp: int, dtype: str) -> int:
    """Bytes of q, k and v of `tokens` (micro-batch x this rank's tokens), K/V heads repeated up to `sp`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = max(getattr(text, "num_key_value_heads", None) or heads, sp)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return tokens * head_dim * (heads + 2 * kv) * _ELEMENT[dtype]


def add_buffers(profile, config):
    """The profile with the all-to-all buffers in every layer's forward and backward transients (sp > 1)."""
    target = profile.target
    if target.sequence_parallel <= 1:
        return profile
    extra = 2 * exchange_bytes(config, target.micro_batch_size * target.seq_len, target.sequence_parallel, target.dtype)
    layers = {m: replace(c, fwd_excess=c.fwd_excess + extra, bwd_excess=c.bwd_excess + extra)
              for m, c in profile.layers.items()}
    return replace(profile, layers=layers)

"""The aten ops one decoder layer's recompute dispatches again, per AC mode: counted on fake tensors, kept like a profile.

A recompute re-runs its unit's forward on the host, and each op goes through the dispatcher again. Op-level recompute
re-runs the whole forward too; the ops its cache answers (the saved matmuls and attention) stop in its dispatch mode.
On a GPU the host may be slower than the kernels it queues, so the time model prices a recompute by these counts as
well (`memtrain.memory.planner.choice_seconds`).

The count is the one `make gpu-check`'s probe makes: a dispatch mode around the step (`memtrain.train.zero3_probe`),
which sees neither the cached ops nor, on real tensors, `prim` metadata calls. It runs on the profile's 1-layer fake
model (`memtrain.memory.profile.fake_model`): the aten ops of one forward and backward under a mode, less under keep.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.memory import profile_cache, tensor_parallel
from memtrain.memory.profile import fake_model, measured_part, mode_plan, packing
from memtrain.memory.target import Target
from memtrain.model.attention import plain
from memtrain.recompute.hooks import apply_plan, remove_plan
from memtrain.recompute.meter import OpCounter
from memtrain.recompute.policy import KEEP


_COUNTED: dict[str, dict[str, int]] = {}  # by key: counted or read once per process


def step_ops(model, mode: str, target: Target) -> int:
    """aten ops of one forward and backward of the 1-layer `model` under `mode` (fake tensors active)."""
    apply_plan(model, mode_plan(model, (mode,)))
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (target.micro_batch_size, target.seq_len), device=device)
    try:
        with OpCounter() as ops:
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        remove_plan(model)
    for p in model.parameters():
        p.grad = None
    return ops.ops


def count_recompute_ops(config, target: Target, modes: tuple[str, ...]) -> dict[str, int]:
    """Mode -> aten ops its recompute adds to one layer's step over `keep` (0 for keep), counted now."""
    config = tensor_parallel.local_config(config, target.tp)
    with FakeTensorMode(allow_non_fake_inputs=True), packing(target.packed), plain():
        model = fake_model(config, 1, target)
        counts = {m: step_ops(model, m, target) for m in dict.fromkeys((KEEP, *modes))}
    return {m: max(0, counts[m] - counts[KEEP]) for m in modes}


def recompute_ops(config, target: Target, modes: tuple[str, ...], config_json: Optional[str] = None) -> dict[str, int]:
    """`count_recompute_ops`, or the same counts where they were kept (memtrain.memory.profile_cache's directory).
    `config_json`: `config.to_json_string()` where the caller has it (a search: about 1 ms a family saved)."""
    name = profile_cache.key(config_json or config.to_json_string(),
                             {**measured_part(target).to_dict(), "what": "recompute_ops"}, modes)
    if name not in _COUNTED:
        def read_kept() -> Optional[dict]:
            kept = profile_cache.read(name)
            valid = isinstance(kept, dict) and set(kept) == set(modes) and all(isinstance(v, int) for v in kept.values())
            return kept if valid else None

        _COUNTED[name] = profile_cache.kept_or_measured(name, read_kept,
                                                        lambda: count_recompute_ops(config, target, modes), dict)
    return _COUNTED[name]


def forget_counted() -> None:
    """Drop this process's counts (kept on disk ones stay): the next call counts or reads again."""
    _COUNTED.clear()

"""Activation checkpointing (AC, recompute): policies -> per-layer plan -> per-layer hooks.

transformers 5.x routes every `GradientCheckpointingLayer.forward` through the layer's own
`_gradient_checkpointing_func` when `layer.gradient_checkpointing` is set, so the plan is
installed layer by layer, with the function chosen by the backend:

* ``torch``: `torch.utils.checkpoint.checkpoint(use_reentrant=False)`;
* ``deepspeed``: `deepspeed.checkpointing.checkpoint` (reentrant), configured from the
  DeepSpeed JSON's `activation_checkpointing` section, which is inert without this.
"""
from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from .errors import UserError
from .metrics import current_activation_meter

POLICY_HELP = "none | full | every:K | first:N"
KEEP, RECOMPUTE = "keep", "full"


@dataclass(frozen=True)
class ACPlan:
    """What each decoder layer does in the backward, and how."""

    policy: str
    layers: tuple[str, ...]  # per layer: KEEP or RECOMPUTE
    backend: str  # "torch" | "deepspeed"
    cpu_checkpointing: bool = False
    partition_activations: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_recomputed(self) -> int:
        return sum(mode != KEEP for mode in self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        backend = {
            "torch": "torch.utils.checkpoint (non-reentrant)",
            "deepspeed": "deepspeed.checkpointing.checkpoint (reentrant)",
        }[self.backend]
        marks = " ".join("R" if m != KEEP else "." for m in self.layers)
        lines = [
            f"AC plan: policy '{self.policy}', {self.num_recomputed}/{len(self.layers)} layers recomputed"
            + (f" with {backend}" if self.num_recomputed else ""),
            f"  layers (R = recompute, . = keep): {marks}",
            f"  partition_activations: {'on' if self.partition_activations else 'off'}; "
            f"cpu_checkpointing: {'on (DeepSpeed offload)' if self.cpu_checkpointing else 'off'}",
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _positive_int(text: str, policy: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) <= 0:
        raise UserError(f"activation_checkpointing.policy: '{policy}': expected a positive integer after ':', "
                        f"got '{text}'; allowed: {POLICY_HELP}")
    return int(text)


def parse_policy(policy: str, num_layers: int) -> tuple[str, ...]:
    """Per-layer modes for a policy string."""
    name, sep, arg = policy.strip().partition(":")
    if name in ("none", "full") and not sep:
        return tuple([RECOMPUTE if name == "full" else KEEP] * num_layers)
    if name == "every" and sep:
        k = _positive_int(arg, policy)
        return tuple(RECOMPUTE if i % k == 0 else KEEP for i in range(num_layers))
    if name == "first" and sep:
        n = _positive_int(arg, policy)
        return tuple(RECOMPUTE if i < n else KEEP for i in range(num_layers))
    raise UserError(f"activation_checkpointing.policy: unknown policy '{policy}'; allowed: {POLICY_HELP}")


def resolve_backend(requested: str, ds_ac: dict) -> str:
    """DeepSpeed's checkpoint when its JSON features are asked for, torch's otherwise."""
    if requested != "auto":
        return requested
    return "deepspeed" if ds_ac["partition_activations"] or ds_ac["cpu_checkpointing"] else "torch"


def effective_policy(section, ds_config: dict) -> str:
    """The JSON switches AC on (its activation_checkpointing section); the recipe says where."""
    if "activation_checkpointing" in ds_config:
        return section.policy
    if "policy" in section.model_fields_set and section.policy != "none":
        raise UserError(f"activation_checkpointing.policy: '{section.policy}' needs an activation_checkpointing "
                        "section in the DeepSpeed JSON, which has none (use e.g. ds_configs/zero3_ckpt.json)")
    return "none"


def build_plan(policy: str, backend: str, ds_ac: dict, num_layers: int, model_parallel_size: int = 1) -> ACPlan:
    layers = parse_policy(policy, num_layers)
    backend = resolve_backend(backend, ds_ac)
    warnings = []
    if ds_ac["partition_activations"] and model_parallel_size == 1:
        warnings.append("partition_activations shards checkpoints across the model-parallel group; "
                        "with no model parallelism (size 1) it shards nothing and saves no memory")
    if backend == "torch" and (ds_ac["partition_activations"] or ds_ac["cpu_checkpointing"]):
        warnings.append("backend 'torch' ignores the JSON's partition_activations/cpu_checkpointing")
    return ACPlan(
        policy=policy,
        layers=layers,
        backend=backend,
        cpu_checkpointing=ds_ac["cpu_checkpointing"] and backend == "deepspeed",
        partition_activations=ds_ac["partition_activations"] and backend == "deepspeed",
        warnings=tuple(warnings),
    )


def _torch_checkpoint(function, *args):
    meter = current_activation_meter()
    if meter is not None and torch.is_grad_enabled():
        meter.retain(args)  # non-reentrant checkpoint keeps its inputs alive via its recompute closure
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def checkpoint_function(backend: str) -> Callable:
    if backend == "torch":
        return _torch_checkpoint
    import deepspeed

    return deepspeed.checkpointing.checkpoint


def configure_deepspeed_ac(ds_config: dict) -> None:
    """Make the JSON's activation_checkpointing section take effect (DeepSpeed leaves it inert)."""
    import deepspeed

    deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)


def apply_plan(layers: nn.ModuleList, plan: ACPlan) -> None:
    """Install the per-layer checkpoint hooks."""
    fn = checkpoint_function(plan.backend) if plan.num_recomputed else None
    for layer, mode in zip(layers, plan.layers):
        layer.gradient_checkpointing = mode != KEEP
        if mode != KEEP:
            layer._gradient_checkpointing_func = fn

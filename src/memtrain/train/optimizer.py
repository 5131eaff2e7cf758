"""memtrain's own AdamW and LR schedule for a DeepSpeed JSON without `optimizer`/`scheduler` sections.

transformers' Trainer builds the optimizer and the scheduler itself when the JSON has none (its
`deepspeed_optim_sched`); memtrain does the same from the recipe's `train.*`, and passes them to
`deepspeed.initialize`. A JSON section, when present, wins: DeepSpeed builds that one.

- optimizer: torch's AdamW (fused on CUDA, foreach elsewhere: no op to JIT-build), or DeepSpeed's
  CPU Adam in AdamW mode when ZeRO offloads the optimizer (DeepSpeed requires its own CPU optimizer
  there). Weight decay applies to every parameter, as with a JSON `AdamW` section, so that a JSON
  with and without the section train the same.
- schedule: DeepSpeed's WarmupCosineLR (linear warm-up over `train.warmup_steps` from 0 to
  `train.lr`, cosine decay to `train.min_lr` at `train.max_steps`), passed as a callable so that
  DeepSpeed builds it on the optimizer it ends up wrapping. With `train.warmup_steps: 0`, `NoWarmupCosine`:
  DeepSpeed's class cannot leave the warm-up out (it takes at least 2 warm-up steps, and its first two learning
  rates are 0 whatever the warm-up: the one before its first step() and the warm-up's start), so a 2-step
  fine-tune would not move its weights at all.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from memtrain.config.ds_config import offload_device
from memtrain.config.ds_validate import schedule_kwargs


def own_optimizer(cfg: dict) -> bool:
    return "optimizer" not in cfg


def own_scheduler(cfg: dict) -> bool:
    return "scheduler" not in cfg


def optimizer_kwargs(recipe) -> dict:
    t = recipe.train
    return {"lr": t.lr, "betas": tuple(t.adam_betas), "eps": t.adam_eps, "weight_decay": t.weight_decay}


def optimizer_name(cfg: dict) -> str:
    """What `build_optimizer` builds for this (resolved) JSON, in words."""
    if offload_device(cfg, "optimizer") != "none":
        return "DeepSpeed's CPU Adam (AdamW mode; the optimizer is offloaded)"
    return f"torch.optim.AdamW ({'fused' if torch.cuda.is_available() else 'foreach'})"


def build_optimizer(params, cfg: dict, recipe) -> torch.optim.Optimizer:
    kwargs = optimizer_kwargs(recipe)
    if offload_device(cfg, "optimizer") != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    impl = {"fused": True} if torch.cuda.is_available() else {"foreach": True}
    return torch.optim.AdamW(params, **kwargs, **impl)


def build_schedule(recipe) -> Callable[[torch.optim.Optimizer], Any]:
    from deepspeed.runtime.lr_schedules import WarmupCosineLR  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    kwargs = schedule_kwargs(recipe)
    if recipe.train.warmup_steps == 0:
        return lambda optimizer: no_warmup_cosine(WarmupCosineLR)(optimizer, **kwargs)
    return lambda optimizer: WarmupCosineLR(optimizer, **kwargs)


def no_warmup_cosine(base: type) -> type:
    """DeepSpeed's WarmupCosineLR (`base`, its state and checkpointing kept) without a warm-up: step k of N (1-based)
    trains at min_lr + (lr - min_lr) * (1 + cos(pi * (k - 1) / (N - 1))) / 2: the full learning rate at step 1, min_lr
    at the last step."""

    class NoWarmupCosine(base):
        def get_lr(self):  # the base gives 0 before its first step(), which is step 1's learning rate
            return [lr * self.get_lr_ratio() for lr in self.org_lrs]

        def get_lr_ratio(self):
            # last_batch_iteration is -1 before the first step() and k - 2 during step k
            progress = min(1.0, max(0, self.last_batch_iteration + 1) / max(1, self.total_num_steps - 1))
            return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2

    return NoWarmupCosine


def engine_arguments(model, cfg: dict, recipe) -> dict:
    """Keyword arguments for `deepspeed.initialize`: the JSON's sections, or memtrain's own. Only the parameters
    that train go to the optimizer (memtrain.model.freeze): a frozen one gets no Adam state and no gradient
    partition under any ZeRO stage."""
    trained = [p for p in model.parameters() if p.requires_grad]
    out: dict[str, Optional[Any]] = {"model": model, "model_parameters": trained, "config": cfg}
    if own_optimizer(cfg):
        out["optimizer"] = build_optimizer(trained, cfg, recipe)
    if own_scheduler(cfg):
        out["lr_scheduler"] = build_schedule(recipe)
    return out


def own_sections(cfg: dict, recipe) -> dict:
    """For config.json: the optimizer and schedule memtrain builds where the JSON has no section."""
    out = {}
    if own_optimizer(cfg):
        out["memtrain_optimizer"] = {"type": optimizer_name(cfg), "params": {**optimizer_kwargs(recipe),
                                                                              "betas": list(recipe.train.adam_betas)}}
    if own_scheduler(cfg):
        out["memtrain_scheduler"] = {"type": "WarmupCosineLR", "params": schedule_kwargs(recipe)}
    return out

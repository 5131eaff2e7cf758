"""fp16's dynamic loss scaler, made visible: the scale and the steps it skipped (TensorBoard
`train/loss_scale`, `train/skipped_steps`, summary.json), and a warning when too many were skipped."""
from __future__ import annotations

from typing import Optional

SKIPPED_WARN_FRACTION = 0.05


def scaler_row(engine) -> dict[str, float]:
    """Host values DeepSpeed keeps (no device sync): the engine counts skipped steps itself."""
    row = {"train/skipped_steps": float(engine.skipped_steps)}
    if engine.fp16_enabled():
        scale = engine._get_optimizer_loss_scale()  # DeepSpeed's own accessor for every fp16 optimizer
        if scale is not None:
            row["train/loss_scale"] = float(scale)
    return row


def skipped_warning(skipped: int, steps: int) -> Optional[str]:
    if steps > 0 and skipped > SKIPPED_WARN_FRACTION * steps:
        return (f"{skipped} of {steps} optimizer steps ({skipped / steps:.0%}) were skipped by fp16's loss scaler "
                "(gradient overflow): the model trained on fewer steps than asked; consider bf16, or a lower "
                "fp16.initial_scale_power / lr")
    return None

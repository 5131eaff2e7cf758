"""Read scalars back from TensorBoard event files with tensorboard's own reader."""
from __future__ import annotations

from pathlib import Path


def read_scalars(tb_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} over every event file in `tb_dir`, sorted by step.

    A step written twice (a run resumed after its last TensorBoard flush) keeps the later value.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415 tensorboard: heavy, kept off --help

    merged: dict[str, dict[int, float]] = {}
    for events in sorted(Path(tb_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            merged.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in merged.items()}

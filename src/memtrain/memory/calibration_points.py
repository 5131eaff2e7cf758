"""A calibration file's measured points: every verified configuration's step, kept so each round refits on them all.

`plan --verify` appends one point per measured configuration to the calibration file's `points:` list and fits
the figures again on every point of the same hardware sheet and device (pooled): one round's runs often cannot
tell the rates apart (round F's eight runs, all at micro-batch 8, put `layer_s` at 0). A point holds what the fit
reads, so a later round refits without the runs: the configuration's label, the counts the overhead term counts,
the bytes sent over the intra-node link, the model's seconds beside the fitted terms, and the measured step.
A point's `base_s` is the model's step under the sheet's compute, memory and host rates when it was measured:
measure the sheet again and the old points no longer fit it (start a new file).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from memtrain.errors import UserError
from memtrain.memory.overhead_fit import LINK, RATES, fit_overheads

COUNTS = (*RATES, *LINK)  # what a point's `counts` holds


@dataclass(frozen=True)
class Point:
    """One configuration measured on one sheet: its runs' median step and what the model counted for it."""

    label: str  # the configuration ("z0 tp1 sp1 mb8 ga1")
    sheet: str  # the hardware sheet's name
    device: str  # cpu or cuda
    date: str  # when its last run finished (UTC)
    measured_s: float  # the median of its runs' step seconds
    spread: float  # (max - min) / median of its runs' tokens/s
    runs: int
    base_s: float  # the model's step less the overhead and the intra-node link bytes' seconds
    compute_efficiency: float  # the sheet's efficiency.compute scaled by predicted / measured step (GPU pooling)
    counts: dict = field(default_factory=dict)  # COUNTS -> number over the step

    def key(self) -> tuple:
        return self.sheet, self.device, self.label, self.date


def to_yaml(p: Point) -> dict:
    d = asdict(p)
    for k in ("measured_s", "base_s", "compute_efficiency", "spread"):
        d[k] = float(f"{d[k]:.6g}")
    d["counts"] = {k: float(f"{p.counts[k]:.9g}") for k in COUNTS}
    return d


def read_points(raw, path: Path) -> list[Point]:
    """The `points:` list of a calibration file ([] when it has none: a file from before pooling)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise UserError(f"{path}: points: expected a list of measured points")
    names = {f for f in Point.__dataclass_fields__}
    points = []
    for n, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != names or not isinstance(item["counts"], dict) \
                or set(item["counts"]) != set(COUNTS):
            raise UserError(f"{path}: points[{n}]: expected the keys {', '.join(sorted(names))}, counts with "
                            f"{', '.join(COUNTS)} (written by plan --verify)")
        try:
            points.append(Point(str(item["label"]), str(item["sheet"]), str(item["device"]), str(item["date"]),
                                float(item["measured_s"]), float(item["spread"]), int(item["runs"]),
                                float(item["base_s"]), float(item["compute_efficiency"]),
                                {k: float(item["counts"][k]) for k in COUNTS}))
        except (TypeError, ValueError):
            raise UserError(f"{path}: points[{n}]: a figure is not a number") from None
    return points


def pooled(old: list[Point], new: list[Point]) -> list[Point]:
    """The old points with the new appended; a new point measured at the same time as an old one replaces it."""
    keys = {p.key() for p in new}
    return [p for p in old if p.key() not in keys] + new


def fit_cpu(points: list[Point], sheet_s_per_byte: float) -> Optional[tuple[dict[str, float], Optional[float]]]:
    """(overhead figures, the intra-node link's fitted bytes/s or None) from points where nothing is hidden; None
    with fewer points than the three overhead rates.

    The link's seconds per byte is fitted beside the three overhead rates when there are more points than rates.
    Where the fit puts it at 0 (the bytes explain nothing), or with only 3 points, the link keeps the sheet's rate
    (`sheet_s_per_byte`) and the three rates are fitted alone."""
    if len(points) < len(RATES):
        return None
    steps = [p.measured_s for p in points]
    if len(points) > len(RATES):
        fit = fit_overheads([p.counts for p in points], [p.measured_s - p.base_s for p in points], steps, link=True)
        per_byte = fit.pop(LINK["intra_bytes"])
        if per_byte > 0:
            return fit, 1.0 / per_byte
    extra = [p.measured_s - p.base_s - p.counts["intra_bytes"] * sheet_s_per_byte for p in points]
    return fit_overheads([p.counts for p in points], extra, steps), None


def pooled_efficiency(points: list[Point]) -> float:
    """A GPU's compute efficiency over every point: the median of each point's (the whole step put on compute)."""
    return statistics.median(p.compute_efficiency for p in points)

"""The step-time model's overhead rates fitted from measured steps: non-negative least squares over the counts.

Each measured run gives its step's seconds beyond every other term of the model (`StepTime.terms` less
"overhead") and what the overhead term counts (`StepTime.counts`). The rates are the non-negative
seconds per count that fit those best (least squares over every subset of rates, the best one whose
rates are all >= 0: exact for the three rates the model has).

Given each run's measured step seconds, the squares are of relative errors (each run's row divided by its step):
tokens/s and the ranking are relative, and in seconds the slowest runs decide the rates. Measured on the CPU
proxy (round E, reports/readme/cpu-proxy/README.md): fitted in seconds, the two 0.8-1 s Ulysses runs (hundreds of
collective calls) set `layer_s` to 0 and left the 0.13-0.23 s runs, the winner's candidates, up to 40% off.

With `link=True` the fit has one more rate: seconds per byte a rank sends over its intra-node link
(`StepTime.intra_bytes`), which `plan --verify` writes as the link's rate. Then `extra_seconds` must also leave out
the model's own link-byte seconds. Only where nothing is hidden (a CPU device) is that term linear in the bytes.
"""
from __future__ import annotations

import itertools
from typing import Optional

import numpy as np

# count name (StepTime.counts) -> the overhead figure of the hardware sheet it sets
RATES = {"layer_calls": "layer_s", "collective_calls": "collective_s", "steps": "step_s"}
# the intra-node link's bytes -> its fitted seconds per byte (not a sheet figure: plan_verify writes 1 / it as the
# link's rate)
LINK = {"intra_bytes": "intra_s_per_byte"}


def fit_overheads(counts: list[dict], extra_seconds: list[float],
                  step_seconds: Optional[list[float]] = None, link: bool = False) -> dict[str, float]:
    """{sheet figure: seconds per count} minimising the squared error of counts x rates against `extra_seconds`
    (each run's measured step seconds less the model's other terms), every rate >= 0; with `step_seconds` (each
    run's measured step), the squared error relative to the step; with `link`, also "intra_s_per_byte" from each
    run's counts["intra_bytes"]."""
    rates = {**RATES, **LINK} if link else RATES
    if len(counts) != len(extra_seconds) or len(counts) < len(rates):
        raise ValueError(f"fit_overheads: needs at least {len(rates)} runs with their counts")
    names = list(rates)
    weight = 1.0 / np.array(step_seconds, dtype=float) if step_seconds is not None else np.ones(len(counts))
    a = np.array([[c[n] for n in names] for c in counts], dtype=float) * weight[:, None]
    y = np.array(extra_seconds, dtype=float) * weight
    scale = np.abs(a).max(axis=0)  # bytes (1e6-1e8) beside calls (1-1e3): columns of one size for lstsq
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_err = np.zeros(len(names)), float(y @ y)
    for k in range(1, len(names) + 1):
        for cols in itertools.combinations(range(len(names)), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(len(names))
            x[list(cols)] = sol
            err = float(((a @ x - y) ** 2).sum())
            if err < best_err - 1e-18:
                best, best_err = x, err
    return {rates[n]: float(v) for n, v in zip(names, best / scale)}

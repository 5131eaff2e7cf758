"""Pooled calibration (`memtrain.memory.calibration_points`, `plan --verify`'s calibrate): a calibration file keeps
the points it was fitted from, each round appends its own, and the figures are the fit of every point of the sheet.
In-process: the tiny recipe's search on the CPU proxy's sheet, with runs made up from known rates (no launch)."""
from __future__ import annotations

import random
import shutil
from dataclasses import replace

import numpy as np
import pytest
import yaml

from conftest import ROOT

from memtrain.errors import UserError

CPU_SHEET = ROOT / "reports" / "readme" / "cpu-proxy" / "cpu-2.yaml"
DS = ROOT / "ds_configs" / "zero3_ckpt.json"
# the "true" rates the made-up runs took: per layer call, per collective call, per step, per intra-node byte sent
TRUTH = (2e-3, 6e-4, 0.05, 1 / 0.1e9)


def _rounds(tmp_path):
    """The sheet (a copy), and two rounds of made-up CPU runs: the model's step less its overhead and link bytes,
    plus the true rates' seconds, off by up to 5% (seeded); each round a different half of the configurations."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search
    from memtrain.tools.plan_verify import Verified

    sheet = tmp_path / "cpu-2.yaml"
    shutil.copy(CPU_SHEET, sheet)
    (tmp_path / "none.yaml").write_text("source: none\n")
    hw = load_hardware(sheet, tmp_path / "none.yaml")
    result = search(load_recipe(None, ["data.seq_len=64"]), load_ds_config(DS), hw, 1, 64 * 16,
                    micro_batches=(1, 4, 16), exact_top=0)
    rng = random.Random(3)
    rows = []
    for i, s in enumerate(result.scored):
        t, c = s.time, s.time.counts
        seconds = (t.seconds - t.terms["overhead"] - t.intra_s + TRUTH[0] * c["layer_calls"]
                   + TRUTH[1] * c["collective_calls"] + TRUTH[2] + TRUTH[3] * t.intra_bytes) * rng.uniform(0.95, 1.05)
        rows.append(Verified(s, i + 1, tmp_path, "completed", result.global_tokens / seconds, None, "cpu",
                             date=f"2026-11-27 0{i % 2}:00"))
    return sheet, rows[0::2], rows[1::2]


def _union_fit(rows) -> np.ndarray:
    """Independent of the code under test: numpy's least squares on the rows' own step-time terms, each row divided
    by its measured step (relative errors); the rates come out positive here, so no bound binds."""
    a, y = [], []
    for r in rows:
        t = r.scored.time
        measured = t.seconds * r.scored.tokens_per_s / r.tokens_per_s
        a.append([t.counts["layer_calls"], t.counts["collective_calls"], 1.0, t.intra_bytes])
        y.append(measured - (t.seconds - t.terms["overhead"] - t.intra_s))
        a[-1] = [v / measured for v in a[-1]]
        y[-1] /= measured
    a = np.array(a)
    scale = a.max(axis=0)
    x = np.linalg.lstsq(a / scale, np.array(y), rcond=None)[0] / scale
    assert (x > 0).all()
    return x


def _figures(sheet, cal) -> np.ndarray:
    from memtrain.memory.hardware import load_hardware

    hw = load_hardware(sheet, cal)
    return np.array([hw.overhead_layer_s, hw.overhead_collective_s, hw.overhead_step_s, 1 / hw.intra_bytes_per_s])


def test_pooling_two_rounds_fits_their_union(tmp_path):
    """Round 1, then round 2 into the same file: the figures are numpy's fit of both rounds' runs together (not
    round 2's alone), every point is kept, the fitted link rate is marked as the calibration's in the figures used,
    and an old file without points still loads and is pooled from its first round on, keeping the figures the fit
    does not set (overhead.host_op_s). Fewer points than rates:
    no fit (no traceback), the points kept."""
    from memtrain.memory.hardware import load_hardware
    from memtrain.tools.plan_verify import calibrate

    sheet, first, second = _rounds(tmp_path)
    assert len({(r.scored.time.counts["layer_calls"], r.scored.time.intra_bytes) for r in first + second}) >= 6
    cal = tmp_path / "cal.yaml"
    # a file from before pooling: overhead figures, no points
    cal.write_text(yaml.safe_dump({"source": "round E", "overhead": {"layer_s": 1e-3, "collective_s": 1e-3,
                                                                     "step_s": 0.1, "host_op_s": 2e-5}}))
    assert load_hardware(sheet, cal).overhead_step_s == 0.1
    assert calibrate(first, sheet, cal)
    assert _figures(sheet, cal) == pytest.approx(_union_fit(first), rel=2e-3)
    assert load_hardware(sheet, cal).host_op_s == 2e-5  # a figure the fit does not set stays
    line = calibrate(second, sheet, cal)
    data = yaml.safe_load(cal.read_text())
    assert len(data["points"]) == len(first) + len(second) and f"{len(first) + len(second)} points" in line
    pooled, alone = _union_fit(first + second), _union_fit(second)
    assert _figures(sheet, cal) == pytest.approx(pooled, rel=2e-3)
    assert np.abs(alone / pooled - 1).max() > 0.01  # pooling changed the fit: round 2 alone differs
    assert _figures(sheet, cal) == pytest.approx(TRUTH, rel=0.3)
    hw = load_hardware(sheet, cal)
    assert hw.origin["gpu.intra_node_gb_per_s"] == str(cal) and hw.origin["overhead.layer_s"] == str(cal)
    # the same round again replaces its points (same configuration, same time), it does not count them twice
    calibrate(second, sheet, cal)
    assert len(yaml.safe_load(cal.read_text())["points"]) == len(first) + len(second)
    assert _figures(sheet, cal) == pytest.approx(pooled, rel=2e-3)

    # too few points to fit: kept, figures unchanged; 3 points fit the three overhead rates, the link stays the sheet's
    few = tmp_path / "few.yaml"
    assert "figures unchanged" in calibrate(first[:2], sheet, few)
    assert "overhead" not in yaml.safe_load(few.read_text()) and len(yaml.safe_load(few.read_text())["points"]) == 2
    calibrate(second[:1], sheet, few)
    assert set(yaml.safe_load(few.read_text())) == {"source", "overhead", "points"}
    assert load_hardware(sheet, few).origin["gpu.intra_node_gb_per_s"] == "sheet"


def test_pooled_gpu_efficiency_and_bad_points_are_one_line(tmp_path):
    """A GPU sheet's rounds pool too: efficiency.compute is the median over every point of the sheet's efficiency
    times measured over predicted tokens/s. A points list that is not one is one line naming the file."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search
    from memtrain.tools.plan_verify import Verified, calibrate

    h100 = ROOT / "hardware" / "h100-sxm-8x.yaml"
    cal = tmp_path / "h100.yaml"
    cal.write_text(yaml.safe_dump({"source": "test", "gpu": {"memory": "0.5GiB"}}))
    implied = []

    def round_of(ratios, n):
        """Runs of the search under the file as it is (as --verify runs it), measured at `ratios` x predicted."""
        hw = load_hardware(h100, cal)
        result = search(load_recipe(None, ["data.seq_len=64"]), load_ds_config(DS), hw, 1, 64 * 8 * 8,
                        micro_batches=(2, 8), exact_top=0)
        implied.extend(hw.compute_efficiency * q for q in ratios)
        return [Verified(s, i + 1, tmp_path, "completed", s.tokens_per_s * q, None, "cuda", date=f"{n}-{i}")
                for i, (s, q) in enumerate(zip(result.scored, ratios))]

    first = load_hardware(h100, cal)
    rows = round_of([0.5, 0.9, 0.6], 1)
    calibrate(rows, h100, cal)
    calibrate(round_of([0.7, 1.1, 0.8], 2), h100, cal)
    union = sorted(implied)
    assert load_hardware(h100, cal).compute_efficiency == pytest.approx(round((union[2] + union[3]) / 2, 4))
    assert len(yaml.safe_load(cal.read_text())["points"]) == 6
    assert load_hardware(h100, cal).intra_bytes_per_s == first.intra_bytes_per_s  # a GPU's link is not fitted

    data = yaml.safe_load(cal.read_text())
    cal.write_text(yaml.safe_dump({**data, "points": 5}))
    with pytest.raises(UserError, match=r"h100.yaml: points: expected a list"):
        load_hardware(h100, cal)
    cal.write_text(yaml.safe_dump({**data, "points": [{**data["points"][0], "measured_s": "fast"}]}))
    with pytest.raises(UserError, match=r"h100.yaml: points\[0\]: a figure is not a number"):
        calibrate([replace(rows[0], date="x")], h100, cal)

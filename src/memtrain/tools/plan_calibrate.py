"""`make plan ARGS="--calibrate-from reports/gpu/<device>.json --hardware hardware/<sheet>.yaml"`: gpu-check's
measurement -> the sheet's calibration file (hardware/calibration/<sheet>.yaml, or --calibration FILE).

What it takes: the MFU of gpu-check's `memtrain:none` set-up (memtrain's trainer, ZeRO-3, no recompute) as
`efficiency.compute`: the share of the dense peak the step-time model applies to the model's FLOPs, measured
through the trainer it plans for. Other figures of an existing calibration file stay.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from memtrain.errors import UserError

SETUP = "memtrain:none"


def compute_efficiency(report_path: Path) -> tuple[float, str]:
    """(MFU of the `memtrain:none` set-up, a line saying where it was measured) from a gpu-check JSON."""
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        results = report["results"]
    except FileNotFoundError:
        raise UserError(f"{report_path}: gpu-check report not found (make gpu-check writes reports/gpu/<device>.json)") \
            from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{report_path}: not a gpu-check report ({e})") from None
    row = next((r for r in results if isinstance(r, dict) and r.get("setup") == SETUP and r.get("mfu")), None)
    if row is None:
        raise UserError(f"{report_path}: no measured '{SETUP}' set-up with an MFU (run make gpu-check with it)")
    when = row.get("measured_at") or "date not recorded"
    return float(row["mfu"]), f"make gpu-check, {report.get('title', report_path.name)}, set-up {SETUP}, {when}"


def write_calibration(report_path: Path, out: Path) -> dict:
    """Write (or update) the calibration file `out`; returns what it holds."""
    mfu, source = compute_efficiency(report_path)
    data = {}
    if out.is_file():
        data = yaml.safe_load(out.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise UserError(f"{out}: a calibration file must be a YAML mapping")
    data = {"source": source, **{k: v for k, v in data.items() if k != "source"}}
    data.setdefault("efficiency", {})["compute"] = round(mfu, 4)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False, width=1 << 16), encoding="utf-8")
    return data


def run_calibrate(args) -> None:
    """`python -m memtrain plan --calibrate-from JSON --hardware SHEET [--calibration FILE]`."""
    from memtrain.memory.hardware import calibration_path, load_hardware  # noqa: PLC0415 pulls pydantic: heavy, imported only when this runs

    if not args.hardware:
        raise UserError("--calibrate-from: needs --hardware FILE (the sheet it calibrates)")
    out = Path(args.calibration) if args.calibration else calibration_path(Path(args.hardware))
    data = write_calibration(Path(args.calibrate_from), out)
    load_hardware(args.hardware, out)  # the file must load over its sheet
    print(f"{out}: efficiency.compute {data['efficiency']['compute']} ({data['source']})")

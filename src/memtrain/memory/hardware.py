"""A node's hardware sheet (`hardware/*.yaml`) and its calibration file: the figures the step-time model uses.

A sheet holds datasheet figures (each with its source in a comment in the file); a calibration file
(`hardware/calibration/<name>.yaml`, or a path given on the command line) overrides any subset of them
with measured ones, and keeps the measured points `plan --verify` fitted them from (`points:`,
`memtrain.memory.calibration_points`). Every figure remembers where it came from ("sheet" or the calibration file), and
the plan prints that. A mistake in either file is one line naming the file and key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError, field_validator

from memtrain.errors import UserError
from memtrain.units import parse_size


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _size(value, key: str):
    return parse_size(value, key) if isinstance(value, str) else int(value * (1 << 30))


class GpuSheet(_Strict):
    memory: int  # bytes (the file writes a size: 80GiB; a bare number is GiB)
    bf16_tflops: PositiveFloat  # dense
    hbm_gb_per_s: PositiveFloat
    intra_node_gb_per_s: PositiveFloat  # per GPU, each direction (NVLink, or PCIe peer to peer)
    inter_node_gb_per_s: PositiveFloat  # per GPU, each direction (its NIC)
    host_gb_per_s: PositiveFloat  # host <-> device, each direction, pinned memory

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value):
        return _size(value, "gpu.memory")


class NodeSheet(_Strict):
    host_ram: int  # bytes
    cores: PositiveInt
    host_mem_gb_per_s: PositiveFloat

    @field_validator("host_ram", mode="before")
    @classmethod
    def _ram(cls, value):
        return _size(value, "node.host_ram")


class EfficiencySheet(_Strict):
    compute: PositiveFloat  # achieved / dense peak in the layers' matmuls
    intra_node_link: PositiveFloat
    inter_node_link: PositiveFloat
    hbm: PositiveFloat
    host_memory: PositiveFloat  # CPU Adam's share of the host memory bandwidth


class OverheadSheet(_Strict):
    """Seconds of per-call overhead (Python, dispatcher, hooks, a collective's fixed cost): 0 unless measured
    (`plan --verify` fits them from measured runs on the sheet's device)."""

    layer_s: NonNegativeFloat = 0.0  # one decoder layer's forward and backward, per micro-step
    collective_s: NonNegativeFloat = 0.0  # one collective call, beyond the link's latency (ZeRO-3's fetch hooks too)
    step_s: NonNegativeFloat = 0.0  # one optimizer step, beyond its terms (engine and optimizer bookkeeping)
    # host seconds per aten op a recompute dispatches again (Python, dispatcher, the recompute's dispatch mode): a
    # recompute costs max(its device seconds, its ops x this); 0: device seconds only. layer_s counts a recompute's
    # calls too: a sheet that sets both charges the recompute's dispatch twice
    host_op_s: NonNegativeFloat = 0.0


class HardwareSheet(_Strict):
    name: str
    device: Literal["cuda", "cpu"] = "cuda"  # what runs a rank: a GPU, or (the CPU proxy) a CPU process
    gpus_per_node: PositiveInt
    gpu: GpuSheet
    node: NodeSheet
    efficiency: EfficiencySheet
    overhead: OverheadSheet = OverheadSheet()


SECTIONS = {"gpu": GpuSheet, "node": NodeSheet, "efficiency": EfficiencySheet, "overhead": OverheadSheet}


@dataclass(frozen=True)
class Hardware:
    """One node kind as the time model reads it: SI rates per second, bytes, and each figure's origin."""

    name: str
    gpus_per_node: int
    gpu_memory: int
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    hbm_bytes_per_s: float
    intra_bytes_per_s: float  # link rate a collective inside a node reaches (sheet x efficiency)
    inter_bytes_per_s: float  # ... across nodes, per GPU
    host_bytes_per_s: float
    host_ram: int
    cores: int
    host_mem_bytes_per_s: float
    compute_efficiency: float
    hbm_efficiency: float
    host_memory_efficiency: float
    origin: dict = field(default_factory=dict)  # "section.key" -> "sheet" or the calibration file's path
    values: dict = field(default_factory=dict)  # "section.key" -> the figure as the file writes it (bytes for sizes)
    overhead_layer_s: float = 0.0  # per decoder layer's forward and backward (OverheadSheet)
    overhead_collective_s: float = 0.0  # per collective call
    overhead_step_s: float = 0.0  # per optimizer step
    host_op_s: float = 0.0  # per aten op a recompute dispatches again (OverheadSheet.host_op_s)
    device: str = "cuda"

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.compute_efficiency

    def figures(self) -> list[tuple[str, object, str]]:
        """(section.key, value, origin) for every figure, in the sheet's order."""
        return [(k, v, self.origin[k]) for k, v in self.values.items()]


def _read(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: {what} not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a {what} must be a YAML mapping")
    return data


def _line(err: ValidationError, source: Path) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "<root>"
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'"
    if e["type"] == "missing":
        return f"{source}: {key}: missing"
    value = e.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) else ""
    return f"{source}: {key}: {e['msg']}{shown}"


def calibration_path(sheet: Path) -> Path:
    """Where a sheet's calibration file lives by default: hardware/calibration/<sheet file name>."""
    return sheet.parent / "calibration" / sheet.name


def load_hardware(path: str | Path, calibration: Optional[str | Path] = None) -> Hardware:
    """The sheet at `path`, with the calibration file's figures over it (`calibration`, else the default
    path when that file exists)."""
    path = Path(path)
    raw = _read(path, "hardware sheet")
    origin = {f"{s}.{k}": "sheet" for s, model in SECTIONS.items() for k in model.model_fields}
    cal_path = Path(calibration) if calibration else calibration_path(path)
    if calibration or cal_path.is_file():
        cal = _read(cal_path, "calibration file")
        cal.pop("source", None)
        if not isinstance(cal.pop("points", None) or [], list):  # the measured points it was fitted from (calibration_points)
            raise UserError(f"{cal_path}: points: expected a list of measured points")
        for section, values in cal.items():
            if section not in SECTIONS:
                raise UserError(f"{cal_path}: unknown key '{section}'; allowed: source, points, {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise UserError(f"{cal_path}: {section}: expected a mapping of figures")
            for key, value in values.items():
                if key not in SECTIONS[section].model_fields:
                    raise UserError(f"{cal_path}: unknown key '{section}.{key}'")
                raw.setdefault(section, {})[key] = value
                origin[f"{section}.{key}"] = str(cal_path)
    try:
        sheet = HardwareSheet.model_validate(raw)
    except ValidationError as e:
        blamed = cal_path if any(o != "sheet" and ".".join(map(str, e.errors()[0]["loc"])) == k
                                 for k, o in origin.items()) else path
        raise UserError(_line(e, blamed)) from None
    g, n, eff, o = sheet.gpu, sheet.node, sheet.efficiency, sheet.overhead
    values = {f"{s}.{k}": v for s in SECTIONS for k, v in getattr(sheet, s).model_dump().items()}
    return Hardware(sheet.name, sheet.gpus_per_node, g.memory, g.bf16_tflops * 1e12, g.hbm_gb_per_s * 1e9,
                    g.intra_node_gb_per_s * 1e9 * eff.intra_node_link, g.inter_node_gb_per_s * 1e9 * eff.inter_node_link,
                    g.host_gb_per_s * 1e9, n.host_ram, n.cores, n.host_mem_gb_per_s * 1e9, eff.compute, eff.hbm,
                    eff.host_memory, origin, values, o.layer_s, o.collective_s, o.step_s, o.host_op_s, sheet.device)

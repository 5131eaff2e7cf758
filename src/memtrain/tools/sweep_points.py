"""A sweep's grid of points, and one point's life: load, prepare, run arguments, outcome, progress bar."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from memtrain.config.recipe import Recipe, did_you_mean, format_validation_error, load_yaml, parse_scalar
from memtrain.errors import UserError
from memtrain.train.run_dir import RunDir

DEFAULT_SWEEP = "recipes/sweeps/tiny-cpu.yaml"
TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"
DS_KEY = "deepspeed"  # the grid key that sweeps DeepSpeed JSON files instead of a recipe key
FINAL = ("completed", "oom", "failed")  # preempted points are resumed, not skipped


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LauncherSection(_Strict):
    name: str = "deepspeed"
    """deepspeed: one launch per point on this machine (make train's launcher: DeepSpeed's runner on GPUs, CPU
    ranks started by memtrain); slurm: one Slurm job array,
    one point per array task (memtrain.slurm). `LAUNCHER=` overrides it."""
    gpus_per_run: PositiveInt = 2
    """Processes per point: GPUs on a GPU machine, CPU ranks (gloo) without one."""


class SweepSpec(_Strict):
    name: Optional[str] = None
    """Run and report folder name (runs/<name>/, reports/<name>/); default: the file's stem."""
    recipe: Optional[str] = None
    """Base recipe YAML; omitted: the embedded tiny recipe."""
    deepspeed: str = "ds_configs/zero3_ckpt.json"
    set: dict[str, Any] = Field(default_factory=dict)
    """`key.path: value` overrides applied to every point."""
    grid: dict[str, list[Any]]
    """`key.path: [values]`; a value may be a mapping of sub-keys set together. Key `deepspeed`: JSON files."""
    keep_checkpoints: bool = False
    """Keep the model checkpoints of completed points (a sweep measures; the save is large on GPU)."""
    launcher: LauncherSection = Field(default_factory=LauncherSection)


@dataclass(frozen=True)
class Point:
    id: str
    values: dict[str, Any]  # flattened swept key -> value, in grid order
    run_dir: Path


@dataclass
class Sweep:
    path: Path
    name: str
    spec: SweepSpec
    points: list[Point]

    @property
    def runs_dir(self) -> Path:
        return Path("runs") / self.name


# --------------------------------------------------------------------------- loading

def _check_recipe_key(key: str, where: str) -> None:
    """A typo in a grid key would fail every point: reject it before anything runs."""
    cls: Any = Recipe
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            if cls is dict or getattr(cls, "__origin__", None) is dict:
                return  # free-form section (model.config)
            raise UserError(f"{where}: '{'.'.join(parts[:i])}' is not a section of the recipe")
        if part not in cls.model_fields:
            raise UserError(f"{where}: unknown recipe key '{key}'; {did_you_mean(Recipe, tuple(parts[:i + 1]))}")
        cls = cls.model_fields[part].annotation
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        raise UserError(f"{where}: '{key}' is a section; name a key in it ({', '.join(cls.model_fields)}), "
                        "or give a mapping of them")


def _flatten(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return {f"{key}.{k}": v for k, v in value.items()}
    return {key: value}


def _slug(value: Any) -> str:
    text = Path(value).stem if isinstance(value, str) and value.endswith(".json") else str(value)
    return re.sub(r"[^A-Za-z0-9._+]+", "-", text).strip("-") or "empty"


def short_names(keys: list[str]) -> dict[str, str]:
    """Column/id names: the last key component, or the full path where that is ambiguous."""
    last = [k.split(".")[-1] for k in keys]
    return {k: (name if last.count(name) == 1 else k) for k, name in zip(keys, last)}


def load_sweep(path: str | Path, sets: Sequence[str] = (), grid: Sequence[str] = ()) -> Sweep:
    """The sweep file, with the command line's overrides (`shrink`): `sets` (KEY=VALUE) apply to every point, `grid`
    (KEY=V1,V2) replaces a grid key's values. An overridden sweep is its own: its runs go to runs/<name>-<hash>/."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: sweep file not found (SWEEP=recipes/sweeps/<name>.yaml)")
    data = load_yaml(path)
    overridden = shrink(data, path, sets, grid)
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, str(path), SweepSpec)) from None
    for key in spec.set:
        _check_recipe_key(key, f"{path}: set")
    if not spec.grid:  # one point whose run directory would be the sweep's own
        raise UserError(f"{path}: grid: needs at least one key with values (an empty grid has no points; "
                        "to run one configuration, use src/train.py or a grid with one value)")
    for key, values in spec.grid.items():
        if not values:
            raise UserError(f"{path}: grid.{key}: needs at least one value")
        for value in values:
            for flat in (_flatten(key, value) if key != DS_KEY else {}):
                _check_recipe_key(flat, f"{path}: grid.{key}")
    for ds in [spec.deepspeed, *spec.grid.get(DS_KEY, [])]:
        if not Path(str(ds)).is_file():
            raise UserError(f"{path}: deepspeed: DeepSpeed config '{ds}' not found")
    if spec.recipe and not Path(spec.recipe).is_file():
        raise UserError(f"{path}: recipe: '{spec.recipe}' not found")
    name = (spec.name or path.stem) + (f"-{overridden}" if overridden else "")
    return Sweep(path, name, spec, _expand(spec, Path("runs") / name, path))


def add_shrink_flags(p) -> None:
    """--set and --grid, for `sweep` and `report` alike (a report finds an overridden sweep's runs by them)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="a recipe key for every point, e.g. --set train.max_steps=10 (runs go to runs/<name>-<hash>/)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="this grid key's values instead of the file's, e.g. --grid train.micro_batch_size=2,4")


def shrink(data: dict, path: Path, sets: Sequence[str], grid: Sequence[str]) -> str:
    """Apply the command line's --set/--grid to a sweep file's data (in place); returns a short hash of them ('' for
    none), which names the overridden sweep: its points never mix with the file's own runs."""
    if not (sets or grid):
        return ""
    for item in (*sets, *grid):
        if "=" not in item or not item.partition("=")[0].strip():
            raise UserError(f"--set/--grid {item!r}: expected KEY=VALUE (--grid KEY=V1,V2)")
    if not isinstance(data.get("set", {}), dict) or not isinstance(data.get("grid"), dict):
        return ""  # the schema names what is wrong
    for item in sets:
        key, _, raw = item.partition("=")
        data.setdefault("set", {})[key.strip()] = parse_scalar(raw)
    for item in grid:
        key, _, raw = item.partition("=")
        key = key.strip()
        if key not in data["grid"]:
            raise UserError(f"--grid {key}: not a grid key of {path} (its keys: {', '.join(data['grid'])})")
        data["grid"][key] = [parse_scalar(v.strip()) for v in raw.split(",") if v.strip()]
    return hashlib.sha256(json.dumps([list(sets), list(grid)]).encode()).hexdigest()[:6]


def _expand(spec: SweepSpec, runs_dir: Path, path: Path) -> list[Point]:
    points, seen = [], {}
    for combo in itertools.product(*spec.grid.values()):
        values: dict[str, Any] = {}
        for key, value in zip(spec.grid, combo):
            values.update(_flatten(key, value))
        names = short_names(list(values))
        pid = ",".join(f"{names[k]}={_slug(v)}" for k, v in values.items())
        if pid in seen:
            raise UserError(f"{path}: grid: points {seen[pid]} and {values} get the same id '{pid}'")
        if not pid or pid.startswith(".") or "/" in pid:  # its run directory must be a child of the sweep's alone
            raise UserError(f"{path}: grid: point {values} gets the id '{pid}', which cannot name a run directory")
        seen[pid] = values
        points.append(Point(pid, values, runs_dir / pid))
    return points


# --------------------------------------------------------------------------- one point

def _yaml_scalar(value: Any) -> str:
    """Text that `--set` parses back (as YAML) to exactly `value`."""
    if isinstance(value, str) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def train_args(sweep: Sweep, point: Point) -> list[str]:
    """Arguments of `src/train.py` for one point (any launcher)."""
    spec = sweep.spec
    args = ["--deepspeed", str(point.values.get(DS_KEY, spec.deepspeed))]
    if spec.recipe:
        args += ["--recipe", spec.recipe]
    overrides = {**spec.set, **{k: v for k, v in point.values.items() if k != DS_KEY}}
    for key, value in overrides.items():
        args += ["--set", f"{key}={_yaml_scalar(value)}"]
    return args + ["--run-dir", str(point.run_dir)]


def read_summary(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads(RunDir(run_dir).summary_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _recorded_args(point: Point) -> Optional[list[str]]:
    try:
        return json.loads((point.run_dir / "point.json").read_text())["args"]
    except (OSError, json.JSONDecodeError, KeyError):
        return None


def is_finished(sweep: Sweep, point: Point) -> bool:
    """Finished with a final status, by the same command (a changed sweep file reruns its points)."""
    summary = read_summary(point.run_dir)
    return bool(summary) and summary.get("status") in FINAL and _recorded_args(point) == train_args(sweep, point)


def finished_differently(sweep: Sweep, point: Point) -> bool:
    """Finished with a final status, but by another command (the sweep file changed since): kept unless forced."""
    summary = read_summary(point.run_dir)
    return bool(summary) and summary.get("status") in FINAL and _recorded_args(point) != train_args(sweep, point)


SET_ASIDE = ".set-aside"  # under the sweep's directory: earlier runs of points that were run again


def set_aside(sweep: Sweep, point: Point) -> Path:
    """Move a point's run directory to `<sweep runs>/.set-aside/<id>-<time>` (a rename: nothing is deleted)."""
    target = sweep.runs_dir / SET_ASIDE / f"{point.id}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while target.exists():
        target, n = target.with_name(f"{target.name.split('~')[0]}~{n}"), n + 1
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(point.run_dir, target)
    return target


def prepare_point(sweep: Sweep, point: Point) -> list[str]:
    """Make the point's run directory ready; return the `train.py` arguments to run it with.

    A point preempted under the same command resumes from its model checkpoint; anything else
    starts from a new directory (old TensorBoard files would otherwise mix into the new run's). An
    earlier run with a summary or model checkpoints is moved aside (`set_aside`), never deleted; a
    directory with neither (a launch that died at once) is removed.
    """
    args = train_args(sweep, point)
    summary = read_summary(point.run_dir)
    if (summary and summary.get("status") == "preempted" and _recorded_args(point) == args
            and (RunDir(point.run_dir).checkpoints / "latest").exists()):
        RunDir(point.run_dir).summary_file.unlink()
        args.append("--resume")
    elif summary or RunDir(point.run_dir).checkpoints.exists():
        set_aside(sweep, point)
    else:
        shutil.rmtree(point.run_dir, ignore_errors=True)
    point.run_dir.mkdir(parents=True, exist_ok=True)
    (point.run_dir / "point.json").write_text(json.dumps(
        {"sweep": str(sweep.path), "id": point.id, "values": point.values, "args": train_args(sweep, point)}, indent=2))
    return args


_NOISE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(INFO|WARNING|DEBUG)\]|^(warnings\.warn|File \"|[~^ ]+$)")
_TELLING = (  # most telling first
    re.compile(r"^memtrain: error: (.*)"),
    re.compile(r"((?:out of memory|OutOfMemoryError).*)", re.IGNORECASE),
    re.compile(r"^((?:[\w.]+(?:Error|Exception)|KeyboardInterrupt|Killed)\b.*)"),
)


def failure_reason(stderr: str, stdout: str = "") -> str:
    """The most telling line of a crashed run's output."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", stderr) if ln.strip()]
    lines = [ln for ln in lines if not re.search(r"\d+/\d+ \[", ln)]  # tqdm redraws
    for pattern in _TELLING:
        found = [m.group(1) for ln in lines if (m := pattern.search(ln))]
        if found:
            return found[-1][:500]
    meaningful = [ln for ln in lines if not _NOISE.search(ln)]
    if meaningful:
        return meaningful[-1][:500]
    errors = [ln for ln in stdout.splitlines() if "[ERROR]" in ln]
    return errors[-1].strip()[:500] if errors else "no output"


def record_outcome(point: Point, returncode: int) -> dict:
    """The point's summary: the trainer's own if it wrote one, else `failed`/`oom` with the reason.

    The reason is read from the point's `stderr.log`/`stdout.log`, where a launcher sends its output.
    """
    summary = read_summary(point.run_dir)
    if summary and summary.get("status") in (*FINAL, "preempted"):
        return summary
    stderr = _read(point.run_dir / "stderr.log")
    if returncode == 0:
        reason = "exited 0 without writing summary.json"
    else:
        reason = failure_reason(stderr, _read(point.run_dir / "stdout.log"))
    from memtrain.train.faults import is_oom_text  # noqa: PLC0415 here: faults imports torch, which --help must not wait for

    status = "oom" if is_oom_text(stderr) else "failed"
    summary = {"status": status, "reason": reason, "returncode": returncode, "steps": last_step(stderr),
               "run_dir": str(point.run_dir), "tensorboard": str(RunDir(point.run_dir).tensorboard),
               "written_by": "memtrain.tools.sweep"}
    RunDir(point.run_dir).summary_file.write_text(json.dumps(summary, indent=2))
    return summary


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def last_step(stderr_tail: str) -> Optional[int]:
    """The step the trainer's tqdm bar last showed (it draws `done/total [` on stderr)."""
    found = re.findall(r"(\d+)/(\d+) \[", stderr_tail)
    return int(found[-1][0]) if found else None


def tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------- launchers

class SweepBar:
    """Outer tqdm bar: points done/left; postfix: the current point and its step."""

    def __init__(self, sweep: Sweep, done: int) -> None:
        from tqdm import tqdm  # noqa: PLC0415 tqdm: kept off --help (this module builds the parser)

        self.bar = tqdm(total=len(sweep.points), initial=done, desc=sweep.name, unit="point", dynamic_ncols=True)
        self.shown, self.drawn = "", 0.0

    def step(self, point: Point, text: str) -> None:
        """Redraw when the step changes, and every few seconds so the clock moves (not every poll)."""
        if f"{point.id} {text}" != self.shown or time.monotonic() - self.drawn > 5:
            self.shown, self.drawn = f"{point.id} {text}", time.monotonic()
            self.bar.set_postfix_str(self.shown, refresh=True)

    def done(self, point: Point, summary: dict) -> None:
        status = summary.get("status")
        if status == "completed":
            tps = (summary.get("metrics") or {}).get("throughput/tokens_per_s")
            detail = f"{tps:,.0f} tokens/s" if tps else ""
        else:
            detail = summary.get("reason") or summary.get("stop_signal") or ""
        self.bar.write(f"{point.id}: {status}" + (f" ({detail})" if detail else ""))
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def finish_point(sweep: Sweep, point: Point, returncode: int, progress: SweepBar) -> dict:
    """After a point's process ended (any launcher): record it, drop its model checkpoints, count it."""
    summary = record_outcome(point, returncode)
    if summary["status"] == "completed" and not sweep.spec.keep_checkpoints:
        shutil.rmtree(RunDir(point.run_dir).checkpoints, ignore_errors=True)
    progress.done(point, summary)
    return summary



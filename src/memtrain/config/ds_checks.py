"""Checks of a resolved DeepSpeed JSON that need the machine or a built object: the optimizer's
parameters (against the class DeepSpeed will build, and its ranges, by constructing it on a dummy
parameter), dtypes the device supports, NVMe offload, "auto"s nobody fills, DeepSpeed op builds
(a build that is coming, a lock left by a killed one). Each problem is one UserError line naming
the key, raised before any worker starts (memtrain.train.preflight calls these)."""
from __future__ import annotations

import inspect
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from memtrain.config.ds_config import get, offload_device, unfillable_auto
from memtrain.errors import NodeError, UserError

# Optimizer params DeepSpeed's engine consumes itself before constructing the class (engine.py,
# _configure_basic_optimizer / get_optimizer_configuration); DeepSpeed has no list of them.
_ENGINE_PARAMS = {"adam": ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach"),
                  "adamw": ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach")}


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_unfilled_auto(raw: dict, source: str) -> None:
    left = unfillable_auto(raw)
    if left:
        raise UserError(f"{source}: {left[0]}: \"auto\" is not a value memtrain can fill (neither can "
                        "transformers); write a value (`python -m memtrain explain-config` lists the keys it fills)")


def _dummy() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


def _adam_class(cfg: dict, params: dict):
    """The class DeepSpeed 0.19.8 constructs for an Adam/AdamW section (engine.get_optimizer_configuration)."""
    if params.get("torch_adam"):
        return torch.optim.AdamW
    if offload_device(cfg, "optimizer") != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        return DeepSpeedCPUAdam
    from deepspeed.ops.adam import FusedAdam  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    return FusedAdam


def check_optimizer(cfg: dict, source: str) -> None:
    """The JSON's optimizer params: names against the class DeepSpeed will build, values by
    building torch's equivalent on a dummy parameter (torch checks lr, betas, eps, weight_decay)."""
    section = cfg.get("optimizer")
    if not isinstance(section, dict):
        return
    name = section.get("type")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise UserError(f"{source}: optimizer.params: expected an object {{...}}, got {json.dumps(params)}")
    if "max_grad_norm" in params:
        raise UserError(f"{source}: optimizer.params.max_grad_norm: not an optimizer parameter in DeepSpeed; "
                        "use the top-level gradient_clipping")
    lname = str(name).lower()
    kwargs = {k: v for k, v in params.items() if k not in _ENGINE_PARAMS.get(lname, ())}
    if lname in ("adam", "adamw"):
        cls = _adam_class(cfg, params)
        torch_kwargs = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
        candidates = [(cls, kwargs), (torch.optim.AdamW, torch_kwargs)]
    elif lname == "adagrad":
        candidates = [(torch.optim.Adagrad, kwargs)]
    elif lname == "lamb":
        from deepspeed.ops.lamb import FusedLamb  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        candidates = [(FusedLamb, kwargs)]
    elif lname == "lion":
        from deepspeed.ops.lion import FusedLion  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        candidates = [(FusedLion, kwargs)]
    elif isinstance(name, str) and isinstance(getattr(torch.optim, name, None), type):
        candidates = [(getattr(torch.optim, name), kwargs)]
    else:
        return  # unknown names are reported by preflight; mu*/muon: signatures outside DeepSpeed
    for cls, kw in candidates:
        try:
            inspect.signature(cls).bind(_dummy(), **kw)
        except TypeError as e:
            bad = next((k for k in kw if k not in inspect.signature(cls).parameters), None)
            where = f"optimizer.params.{bad}" if bad else "optimizer.params"
            allowed = [p for p in inspect.signature(cls).parameters if p not in ("params", "model_params")]
            raise UserError(f"{source}: {where}: not a parameter of {cls.__name__}, which DeepSpeed builds for "
                            f"{json.dumps(name)} here ({_first_line(e)}); allowed: {', '.join(allowed)}") from None
        if cls.__module__.startswith("torch."):
            # implementation switches need the real device (fused=True refuses a CPU dummy): ranges only
            values = {k: v for k, v in kw.items() if k not in ("fused", "foreach", "capturable")}
            try:
                cls(_dummy(), **values)
            except Exception as e:  # torch checks its ranges in __init__ (ValueError, TypeError)
                raise UserError(f"{source}: optimizer.params: {cls.__name__} rejects them: {_first_line(e)}") from None


def check_dtype_support(cfg: dict, source: str) -> None:
    """fp16/bf16 on an accelerator that lacks it: DeepSpeed raises on every rank at initialize."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    acc = get_accelerator()
    for key, supported in (("fp16", acc.is_fp16_supported), ("bf16", acc.is_bf16_supported)):
        if get(cfg, f"{key}.enabled") is True and not supported():
            raise NodeError(f"{source}: {key}.enabled: true, but this machine's accelerator "
                            f"({acc.device_name()}) does not support {key}; set it to false, or \"auto\" "
                            "(bf16 where supported)")


def check_nvme(cfg: dict, source: str) -> None:
    """NVMe offload: the path must exist and be writable, and DeepSpeed's async_io op must build."""
    for what in ("param", "optimizer"):
        if offload_device(cfg, what) != "nvme":
            continue
        key = f"zero_optimization.offload_{what}"
        path = get(cfg, f"{key}.nvme_path")
        if not path:
            raise UserError(f"{source}: {key}.nvme_path: device nvme needs a path on an NVMe drive")
        p = Path(path)
        if not p.is_dir():
            raise NodeError(f"{source}: {key}.nvme_path: {p} is not an existing directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise NodeError(f"{source}: {key}.nvme_path: {p} is not writable")
        from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise NodeError(f"{source}: {key}.device: nvme needs DeepSpeed's async_io op, which cannot be built "
                            "on this machine (libaio and its headers are missing: apt-get install libaio-dev)")


# --------------------------------------------------------------------------- DeepSpeed op builds

def _extensions_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory  # noqa: PLC0415 cpp_extension (with setuptools): 0.3 s to import, only where an op loads

    return Path(_get_build_directory("x", verbose=False)).parent


def loads_ops(cfg: dict) -> bool:
    """Whether the engine may load a DeepSpeed op (JIT-built where it is not built yet). Not on the usual run:
    torch's AdamW (a JSON `optimizer` with `torch_adam`, or none: memtrain's own) with nothing offloaded; that run
    never imports torch.utils.cpp_extension for the ops."""
    if offload_device(cfg, "optimizer") != "none" or offload_device(cfg, "param") != "none":
        return True
    if "optimizer" not in cfg:
        return False
    name = str(get(cfg, "optimizer.type", "")).lower()
    return not (name in ("adam", "adamw") and get(cfg, "optimizer.params.torch_adam"))


def op_builds(cfg: dict) -> list[str]:
    """DeepSpeed ops this JSON makes the engine JIT-build that are not built yet."""
    name = str(get(cfg, "optimizer.type", "")).lower()
    ops = []
    if offload_device(cfg, "optimizer") != "none" and (name in ("", "adam", "adamw") or "optimizer" not in cfg):
        ops.append("cpu_adam")
    elif name in ("adam", "adamw") and not get(cfg, "optimizer.params.torch_adam"):
        ops.append("fused_adam")
    if not ops:
        return []
    try:
        from deepspeed.git_version_info import installed_ops  # noqa: PLC0415 inside its ImportError guard: a DeepSpeed build may lack it
    except ImportError:
        installed_ops = {}
    root = _extensions_dir()
    return [op for op in ops if not installed_ops.get(op) and not list((root / op).glob("*.so"))]


def build_notice(cfg: dict) -> Optional[str]:
    ops = op_builds(cfg)
    if not ops:
        return None
    return (f"DeepSpeed will JIT-build its {', '.join(ops)} op at this launch (minutes on a small CPU; once per "
            f"venv, cached in {_extensions_dir()})")


def _held_by_live_process(folder: Path) -> bool:
    """A build runs ninja (or the compiler) with its working directory in the op's folder."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")).resolve() == folder.resolve():
                return True
        except OSError:
            continue
    return False


# Filesystems other nodes may write too (a shared home): their builds run on processes this node cannot see.
SHARED_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs",
                      "fuse.glusterfs", "fuse.beegfs", "panfs", "wekafs", "9p", "virtiofs", "afs"}
SHARED_MIN_QUIET_S = 1800.0  # on a shared filesystem: a lock, and its build folder, untouched this long


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on (its longest mount point in /proc/self/mounts)."""
    path = path.resolve()
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        point = fields[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def clear_stale_build_locks(min_age_s: float = 60.0, shared: Optional[bool] = None) -> list[str]:
    """torch's extension builds take `<op>/lock`; a build killed midway leaves it, and every later
    launch then waits on it forever, silently. A lock older than `min_age_s` that no live process
    builds under is removed; returns one line per removed lock.

    On a filesystem other nodes share (`shared`; by default read from the mount table), another node's live
    build has no process here: a lock is removed only when it and everything in its build folder have been
    untouched for SHARED_MIN_QUIET_S (a live build writes its objects and ninja's log as it goes)."""
    out = []
    root = _extensions_dir()
    if shared is None:
        shared = filesystem_type(root) in SHARED_FILESYSTEMS
    for lock in root.glob("*/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            quiet = time.time() - max(p.stat().st_mtime for p in (lock.parent, *lock.parent.rglob("*")))
        except (OSError, ValueError):
            continue
        if age < min_age_s or _held_by_live_process(lock.parent):
            continue
        if shared and min(age, quiet) < SHARED_MIN_QUIET_S:
            continue  # perhaps another node's build: its processes are not in this node's /proc
        lock.unlink(missing_ok=True)
        out.append(f"removed {lock}: a lock left by an interrupted DeepSpeed op build ({age:.0f} s old, no live "
                   "build" + (f", nothing in its folder written for {quiet:.0f} s on a shared filesystem" if shared
                              else "") + "), which would make this launch wait forever")
    return out

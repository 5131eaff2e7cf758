"""A `model.pretrained` directory checked before any worker starts, without reading a tensor.

The weight files transformers will load (its own order: `model.safetensors`, `model.safetensors.index.json`
and the shards it names, `pytorch_model.bin`, `pytorch_model.bin.index.json`) must be there and whole: a
safetensors file's header (an 8-byte length and JSON) declares each tensor's byte range, checked against the
file's size; a `pytorch_model.bin` is a zip whose central directory sits at its end. The shapes those headers
declare are compared with the model the recipe builds (on the meta device), so a `model.config` override that
disagrees with the checkpoint is one line naming the parameter and the keys, not a state-dict traceback in every
worker. Cost: a few kilobytes read per file, whatever the checkpoint's size.
"""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import UserError

SAFE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_HEADER_LIMIT = 100 << 20  # safetensors refuses headers over 100 MB


def weight_files(directory: Path) -> list[Path]:
    """The files transformers' `from_pretrained` will read, in its order; one line where there are none, or an
    index names a shard that is missing."""
    explicit = _explicit_weights(directory)
    for name in ([explicit] if explicit else [SAFE, SAFE_INDEX, BIN, BIN_INDEX]):
        path = directory / name
        if not path.is_file():
            if explicit:
                raise UserError(f"model.pretrained: {directory / 'config.json'}: transformers_weights names {name}, "
                                "which is not there")
            continue
        if not name.endswith(".index.json"):
            return [path]
        return _shards(path)
    raise UserError(f"model.pretrained: {directory} holds config.json but no weight file ({SAFE}, {SAFE_INDEX}, "
                    f"{BIN} or {BIN_INDEX}); copy the checkpoint's weights there, or leave model.pretrained unset "
                    "to train from config")


def _explicit_weights(directory: Path) -> Optional[str]:
    """config.json's `transformers_weights`: the one file transformers then loads."""
    try:
        value = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise UserError(f"model.pretrained: {index}: not a weight index (a JSON object with a weight_map "
                        "of tensor -> shard file)") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise UserError(f"model.pretrained: {index}: names shard {missing[0]}, which is not in {index.parent}"
                        + (f" ({len(missing)} shards missing)" if len(missing) > 1 else ""))
    return [index.parent / n for n in names]


def declared_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape as the files' headers declare it, and its file; one line naming a file that is
    truncated or not what its name says."""
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in files:
        found = _safetensors_shapes(f) if f.name.endswith(".safetensors") else _bin_shapes(f)
        shapes.update({name: (shape, f) for name, shape in found.items()})
    return shapes


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    size = path.stat().st_size
    broken = f"model.pretrained: {path}: truncated or not a safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{broken} ({size} bytes, shorter than the 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT or 8 + length > size:
            raise UserError(f"{broken} (its header declares {length:,} bytes of metadata; the file holds {size:,})")
        try:
            header = json.loads(f.read(length))
            entries = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
            shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in entries.items()}
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise UserError(f"{broken} (its header is not the JSON safetensors writes)") from None
    if 8 + length + end > size:
        raise UserError(f"{broken}: its header declares {8 + length + end:,} bytes, the file holds {size:,}")
    return shapes


def _bin_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """A torch zip checkpoint: its central directory (at the end: a truncated file has none); the shapes from
    torch.load with mmap (the storages are mapped, not read)."""
    import torch  # noqa: PLC0415 torch: heavy, imported only when this runs

    size = path.stat().st_size
    broken = f"model.pretrained: {path}: truncated or not a torch checkpoint"
    if not zipfile.is_zipfile(path):
        raise UserError(f"{broken} (no zip directory at its end; {size:,} bytes)")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # pickle and storage errors of several types
        raise UserError(f"{broken}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_pretrained(section, model) -> None:
    """The weight files whole, and the model the recipe builds (`model`, on meta: `build_on_meta`) of the shapes
    they declare. Where `model.config` overrides keys of the checkpoint's config.json, the parameters must be the
    ones the checkpoint's own config gives (names and shapes): a new layer or head would start random."""
    directory = Path(section.pretrained)
    files = weight_files(directory)
    shapes = declared_shapes(files)
    differing = _overrides(section)
    keys = ", ".join(f"{k} {_shown(mine)} (config.json: {_shown(theirs)})" for k, mine, theirs in differing)
    fix = "drop it (--set model.config={}) to train the checkpoint as saved"
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name in shapes and tuple(p.shape) != shapes[name][0]:
            what = f"{name} is {list(p.shape)} in the configured model, {list(shapes[name][0])} in {shapes[name][1]}"
            if differing:
                raise UserError(f"model.config: {keys} disagrees with model.pretrained: {what}; {fix}")
            raise UserError(f"model.pretrained: {what} (the model its config.json describes)")
    if differing:  # against the model the checkpoint's own config builds: tensors stored under other names
        own = _own_parameters(section)  # (fused MoE experts) of other shapes, and parameters loaded as random
        resized = [n for n, p in params.items() if n in own and tuple(p.shape) != own[n]]
        if resized:
            n = resized[0]
            raise UserError(f"model.config: {keys} disagrees with model.pretrained: {n} is {list(params[n].shape)} in "
                            f"the configured model, {list(own[n])} in the checkpoint's; {fix}")
        extra = [n for n in params if n not in own] or [n for n in own if n not in params]
        if extra:
            side = "the configured model has" if extra[0] in params else "the configured model lacks"
            raise UserError(f"model.config: {keys} disagrees with model.pretrained: {side} {extra[0]}, which the "
                            f"checkpoint's config gives {'no' if extra[0] in params else 'a'} weight; {fix}")


def _overrides(section) -> list[tuple[str, Any, Any]]:
    """(key, recipe value, config.json value) for each model.config key that changes the checkpoint's config."""
    from transformers import AutoConfig  # noqa: PLC0415 transformers: heavy, imported only when this runs

    own = AutoConfig.from_pretrained(section.pretrained, local_files_only=True)
    absent = object()
    out = []
    for key, value in section.config.items():
        theirs = getattr(own, key, absent)
        if theirs is absent or _plain(theirs) != _plain(value):
            out.append((key, value, None if theirs is absent else theirs))
    return out


def _own_parameters(section) -> dict:
    """The parameters of the model the checkpoint's own config.json builds (on meta), by name."""
    import torch  # noqa: PLC0415 torch: heavy, imported only when this runs
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 transformers: heavy, imported only when this runs

    own = AutoConfig.from_pretrained(section.pretrained, local_files_only=True)
    own.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(own)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _shown(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value, default=str)

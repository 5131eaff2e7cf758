"""Memory sizes: the one parser for sizes users write (BUDGET=, memory_budget, --budget) and GiB formatting.

Units follow the SI/IEC rule that nvidia-smi, Kubernetes and `df -H` follow: KiB/MiB/GiB/TiB (and
Ki/Mi/Gi/Ti) are powers of 1024; kB/KB/MB/GB/TB (and K/M/G/T) are powers of 1000. A bare number is GiB,
the unit memtrain prints everywhere. So `40GiB` = 40 GiB and `40GB` = 37.25 GiB, in every command.
"""
from __future__ import annotations

import math
import re

from memtrain.errors import UserError

GIB = float(1 << 30)
_UNITS = {"": 1 << 30,
          "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "b": 1}
_SIZE = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text, key: str) -> int:
    """'40GiB', '40Gi', '512MiB', '40GB' (SI), '1.5TB', '40' (GiB) -> bytes; anything else is one line naming `key`."""
    m = _SIZE.fullmatch(str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise UserError(f"{key}: '{text}' is not a memory size (e.g. 40GiB, 512MiB, 80GB, or 40 for GiB)")
    value = float(m.group(1))
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{key}: '{text}' must be a positive memory size (e.g. 40GiB)")
    return int(value * unit)


def gib(x: float) -> float:
    return x / GIB

"""Per-step phase times of CPU-proxy runs from DeepSpeed's wall_clock_breakdown (reports/readme/cpu-proxy/README.md).

Each run's ds.json had "wall_clock_breakdown": true and "steps_per_print": 1; rank 0 then prints
"time (ms) | fwd: … | bwd: … | bwd_inner: … | bwd_allreduce: … | step: …" (and, under ZeRO-1/2,
"optimizer_allgather / optimizer_gradients / optimizer_step") in stdout.log every step. This prints, per
configuration, the median over steps 4-12 of each phase, then across the configuration's runs the median
[min-max], with the run's tokens/s.

    python reports/readme/cpu-proxy/phases.py 'runs/rankexp-r*'
"""
import glob
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

WARMUP = 3  # steps left out: the first steps build buffers (and CPU Adam) and run slow


def phases(stdout: Path) -> dict[str, float]:
    ph, steps = defaultdict(list), 0
    for line in stdout.read_text().splitlines():
        if "[Rank 0] time (ms) |" not in line or "microstep" in line:
            continue
        steps += "fwd:" in line
        if steps > WARMUP:
            for k, v in re.findall(r"(\w+): ([\d.]+)", line.split("|", 1)[1]):
                ph[k].append(float(v))
    return {k: statistics.median(v) for k, v in ph.items()}


def main(pattern: str) -> None:
    rows = defaultdict(lambda: defaultdict(list))
    for d in sorted(Path(p) for p in glob.glob(pattern)):
        run = d / "max_steps=12"
        try:
            tok = json.loads((run / "summary.json").read_text())["metrics"]["throughput/tokens_per_s"]
        except (OSError, KeyError, ValueError):
            continue
        cfg = d.name.split("-", 2)[2]
        rows[cfg]["tok_s"].append(tok)
        for k, v in phases(run / "stdout.log").items():
            rows[cfg][k].append(v)
    for cfg, r in rows.items():
        print(f"{cfg:40s} " + " ".join(f"{k}={statistics.median(v):.1f}[{min(v):.0f}-{max(v):.0f}]"
                                        for k, v in r.items()))


if __name__ == "__main__":
    main(sys.argv[1])

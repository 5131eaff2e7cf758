"""The CPU proxy's fits (docs/planner-search.md): runs measured by `plan --search ... --verify` (possibly under an
earlier sheet or calibration), scored again under cpu-2.yaml and fed to `--verify`'s own calibrate (the overhead fit).

    PYTHONPATH=src python reports/readme/cpu-proxy/fit_rounds.py CALIBRATION_YAML ROUND_OUT...

ROUND_OUT is the --out of a --verify run (its verify/<n>-rank<r>[-<config>]/ files); the runs are read from runs/,
every repeat a configuration has (the median of its runs, as --verify-repeats reads them).
"""
import sys
from pathlib import Path

import yaml

from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.memory.hardware import load_hardware
from memtrain.memory.search import search
from memtrain.tools.flags import DEFAULT_DS
from memtrain.tools.plan_verify import Verified, calibrate, combined, format_verify
from memtrain.tools.sweep_points import read_summary

SHEET = Path(__file__).resolve().parent / "cpu-2.yaml"


def main(calibration: Path, rounds: list[Path]) -> None:
    recipe = load_recipe(None, ["data.seq_len=128"])
    result = search(recipe, load_ds_config(DEFAULT_DS), load_hardware(SHEET, calibration), 1, 2048)
    by_label = {s.config.label(): (i, s) for i, s in enumerate(result.scored)}
    rows = []
    for d in sorted(d for r in rounds for d in (r / "verify").iterdir()):
        # the recipe's first line names its configuration: "... --search`: z3 off:param tp1 sp1 mb1 ga8, predicted"
        label = (d / "recipe.yaml").read_text().splitlines()[0].split(": ", 1)[1].split(", predicted")[0]
        i, s = by_label[label]
        runs = []
        for sweep in sorted(d.glob("sweep*.yaml")):  # sweep.yaml (one run, rounds A-C) or sweep-r<j>.yaml (repeats)
            run_dir = Path("runs") / yaml.safe_load(sweep.read_text())["name"] / "max_steps=12"
            summary = read_summary(run_dir)
            if not summary or not (summary.get("metrics") or {}).get("throughput/tokens_per_s"):
                continue  # not run (yet): a round stopped part way reads the runs it has
            runs.append(Verified(s, i + 1, run_dir, summary["status"], summary["metrics"]["throughput/tokens_per_s"],
                                 None, summary["device"]))
        if runs:
            rows.append(combined(runs))
    print(format_verify(rows))
    print(calibrate(rows, SHEET, calibration) if len(rows) >= 3 else "calibration: not fitted (fewer than 3 runs)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])

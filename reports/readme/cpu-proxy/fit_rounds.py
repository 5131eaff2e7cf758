"""The CPU proxy's pooled fit and its offline checks (reports/readme/cpu-proxy/README.md): runs measured by
`plan --search ... --verify` (under any earlier sheet or calibration) are scored again under cpu-2.yaml, fed round by
round to `--verify`'s own calibrate (each round's points appended to the file's, the figures fitted on all), and the
fit is checked on runs it did not see: leave one configuration out, and one round fitted on the others.

    PYTHONPATH=src python reports/readme/cpu-proxy/fit_rounds.py --tsv RUNS_DIR ROUND_OUT... > runs.tsv
    PYTHONPATH=src python reports/readme/cpu-proxy/fit_rounds.py OUT_CALIBRATION runs.tsv

The first lists every run of the rounds (ROUND_OUT: a --verify run's --out, its verify/<n>-rank<r>-<config>/ files;
the runs read from RUNS_DIR, the runs/ of the checkout that ran it): round, configuration, run, tokens/s, and when its
summary.json was written. The second scores them (a configuration's figure is the median of its runs, as
--verify-repeats reads them) and writes OUT_CALIBRATION (an existing file's points are kept). Nothing is run.
"""
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.memory.calibration_points import Point, fit_cpu, read_points
from memtrain.memory.hardware import load_hardware
from memtrain.memory.overhead_fit import fit_overheads
from memtrain.memory.search import search
from memtrain.tools.flags import DEFAULT_DS
from memtrain.tools.plan_search import format_search
from memtrain.tools.plan_verify import Verified, calibrate, combined, finished, format_verify, kendall_tau, pick
from memtrain.tools.sweep_points import read_summary

SHEET = Path(__file__).resolve().parent / "cpu-2.yaml"
TOKENS = 2048  # the rounds' global batch: the tiny recipe at sequence 128


def scored_search(calibration: Path):
    recipe = load_recipe(None, ["data.seq_len=128"])
    return search(recipe, load_ds_config(DEFAULT_DS), load_hardware(SHEET, calibration), 1, TOKENS)


def tsv_rows(runs: Path, rounds: list[Path]) -> list[str]:
    """Every run of the rounds as a line: round, configuration, run, tokens/s, when it finished."""
    lines = ["round\tconfiguration\trun\ttokens_per_s\tfinished"]
    for out in rounds:
        for d in sorted((out / "verify").iterdir()):
            # the recipe's first line names its configuration: "... --search`: z3 off:param tp1 sp1 mb1 ga8, predicted"
            label = (d / "recipe.yaml").read_text().splitlines()[0].split(": ", 1)[1].split(", predicted")[0]
            for sweep in sorted(d.glob("sweep*.yaml")):
                name = yaml.safe_load(sweep.read_text())["name"]
                run_dir = runs / name / "max_steps=12"
                tokens = ((read_summary(run_dir) or {}).get("metrics") or {}).get("throughput/tokens_per_s")
                if tokens:
                    lines.append(f"{out.name}\t{label}\t{name}\t{tokens:.1f}\t{finished(run_dir)}")
    return lines


def round_rows(result, lines: list[list[str]]) -> list[Verified]:
    """One round's runs (tsv fields) as --verify reads them, scored in `result` (the sheet without overhead)."""
    by_label = {s.config.label(): i for i, s in enumerate(result.scored)}
    rows = []
    for label in dict.fromkeys(f[1] for f in lines):
        i = by_label[label]
        rows.append(combined([Verified(result.scored[i], i + 1, Path(f[2]), "completed", float(f[3]), None, "cpu",
                                       date=f[4]) for f in lines if f[1] == label]))
    return rows


def predict(fit_on: list[Point], test: list[Point], link: bool) -> list[float]:
    """Test points' step seconds under the rates fitted on `fit_on` (with the link's rate fitted, or the sheet's)."""
    sheet_s_per_byte = 1.0 / load_hardware(SHEET, _empty()).intra_bytes_per_s
    if link:
        over, rate = fit_cpu(fit_on, sheet_s_per_byte)
        per_byte = 1.0 / rate if rate else sheet_s_per_byte
    else:
        extra = [p.measured_s - p.base_s - p.counts["intra_bytes"] * sheet_s_per_byte for p in fit_on]
        over = fit_overheads([p.counts for p in fit_on], extra, [p.measured_s for p in fit_on])
        per_byte = sheet_s_per_byte
    return [p.base_s + over["layer_s"] * p.counts["layer_calls"] + over["collective_s"] * p.counts["collective_calls"]
            + over["step_s"] + per_byte * p.counts["intra_bytes"] for p in test]


def scores(test: list[Point], predicted_s: list[float]) -> str:
    """tau, the predicted best's share of the best measured, median |error| (tokens/s) of predictions for `test`."""
    pred = [TOKENS / s for s in predicted_s]
    meas = [TOKENS / p.measured_s for p in test]
    best = max(range(len(test)), key=lambda i: (pred[i], -i))
    err = statistics.median(abs(m / q - 1) for m, q in zip(meas, pred))
    return f"tau {kendall_tau(pred, meas):.2f}, predicted best {test[best].label} at {meas[best] / max(meas):.1%}, " \
           f"median |error| {err:.0%}"


def _empty() -> Path:
    """A calibration file with no figures: the sheet alone (not the default calibration file beside it)."""
    path = Path(tempfile.gettempdir()) / "fit_rounds-empty.yaml"
    path.write_text("source: none\n")
    return path


def checks(points: dict[str, list[Point]]) -> None:
    """Leave-one-out within each round and over all, and each round predicted from the others' fit."""
    every = [p for ps in points.values() for p in ps]
    for link in (True, False):
        print(f"\n== {'link rate fitted' if link else 'link at the sheet rate, 3 rates fitted'} ==")
        for name, ps in [*points.items(), ("all", every)]:
            loo = [predict(ps[:i] + ps[i + 1:], [p], link)[0] for i, p in enumerate(ps)]
            print(f"leave one out, {name} ({len(ps)} points): {scores(ps, loo)}")
        for name, ps in points.items():
            others = [p for n, q in points.items() if n != name for p in q]
            if len(others) >= 4:
                print(f"{name} from the others' fit ({len(others)} points): {scores(ps, predict(others, ps, link))}")
            print(f"{name} in sample: {scores(ps, predict(ps, ps, link))}")


def main(out_cal: Path, tsv: Path) -> None:
    result = scored_search(_empty())
    fields = [line.split("\t") for line in tsv.read_text().splitlines()[1:] if line.strip()]
    points: dict[str, list[Point]] = {}
    for name in dict.fromkeys(f[0] for f in fields):
        rows = round_rows(result, [f for f in fields if f[0] == name])
        print(f"\n# {name}\n" + format_verify(rows))
        before = {p.key() for p in _points(out_cal)}
        print(calibrate(rows, SHEET, out_cal))
        points[name] = [p for p in _points(out_cal) if p.key() not in before]
    checks(points)
    every = [p for ps in points.values() for p in ps]
    print("\nleave one out over all points, the link's rate fitted: configuration, round, measured and predicted step s")
    for i, p in enumerate(every):
        q = predict(every[:i] + every[i + 1:], [p], True)[0]
        print(f"  {p.label:<34} {p.date}  {p.measured_s:.4f}  {q:.4f}  tokens/s {q / p.measured_s - 1:+.0%}")
    print("\n# the search with the pooled calibration")
    calibrated = scored_search(out_cal)
    print(format_search(calibrated, load_recipe(None, ["data.seq_len=128"]), load_hardware(SHEET, out_cal), 1, top=12))
    print("\nwhat --verify 5 would run with it (rank, configuration, predicted tokens/s; measured medians of earlier rounds):")
    for i in pick(calibrated.scored, 5):
        s = calibrated.scored[i]
        seen = [f"{TOKENS / p.measured_s:,.0f} ({p.date[11:]})" for p in every if p.label == s.config.label()]
        print(f"  {i + 1:>4}  {s.config.label():<34} {s.tokens_per_s:>8,.0f}  {', '.join(seen) or 'not measured'}")


def _points(cal: Path) -> list[Point]:
    return read_points((yaml.safe_load(cal.read_text()) or {}).get("points"), cal) if cal.is_file() else []


if __name__ == "__main__":
    if sys.argv[1] == "--tsv":
        print("\n".join(tsv_rows(Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]])))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))

"""The planner's backtest on a gpu-check report (reports/readme/backtest-h100.md): each set-up's tokens/s as the
step-time model predicts it (`memtrain.memory.score.score`) against what gpu-check measured.

    PYTHONPATH=src python reports/readme/backtest_h100.py [REPORT_JSON] > table.md

REPORT_JSON: a `make gpu-check` report of recipes/llama-1b.yaml with ds_configs/zero3_ckpt.json on one GPU
(default reports/readme/gpu-h100-2026-11-27.json). Each set-up is scored as the search scores a configuration:
ZeRO-3 on one GPU of hardware/h100-sxm-8x.yaml, the report's micro-batch, the per-layer plan the report shows
(its plan string; `+offload`: every recomputed layer but the last offloaded, as memtrain's offload runs), on a
profile measured at that micro-batch. Twice: with the sheet's figures, and calibrated as
`plan --calibrate-from REPORT_JSON` calibrates (the MFU of `memtrain:none`, so that row is in sample).
Nothing is run on a GPU.
"""
import json
import sys
import tempfile
from pathlib import Path

from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.memory.flops import model_flops_per_token
from memtrain.memory.hardware import load_hardware
from memtrain.memory.plan_files import variant_ds
from memtrain.memory.predict import LayerChoice
from memtrain.memory.score import Setting, make_family, score, sheet_rates
from memtrain.memory.states import model_states
from memtrain.memory.target import model_and_config
from memtrain.tools.bench.setups import parse_setup
from memtrain.tools.plan_calibrate import SETUP, write_calibration

ROOT = Path(__file__).resolve().parents[2]
SHEET = ROOT / "hardware" / "h100-sxm-8x.yaml"
DS = ROOT / "ds_configs" / "zero3_ckpt.json"
RECIPE = ROOT / "recipes" / "llama-1b.yaml"
REPORT = ROOT / "reports" / "readme" / "gpu-h100-2026-11-27.json"
MODES = {".": "keep", "R": "full", "O": "op", "A": "attn", "M": "mlp"}
# the plan torch:noac runs, scored the same way: the trainer's nearest set-up (no recompute)
PLAIN = "torch:noac"


def plan_of(row: dict, offload: bool, layers: int) -> tuple[LayerChoice, ...]:
    """The report's plan string as layer choices (no plan: every layer kept); with offload, every recomputed layer
    but the last offloaded (memtrain.recompute.offload keeps the last one's input: its backward comes first)."""
    modes = [MODES[m] for m in row["plan"]] if row.get("plan") else ["keep"] * layers
    last = max((i for i, m in enumerate(modes) if m == "full"), default=-1)
    return tuple(LayerChoice(m, offload=offload and m == "full" and i != last) for i, m in enumerate(modes))


def setup_ds(base: dict, setup) -> dict:
    """The JSON gpu-check ran the set-up with (bench/runner.py's keys)."""
    ds = variant_ds(base, 3, False, False)
    ds.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = setup.cpu_checkpointing
    if not setup.leaf:
        ds["zero_optimization"]["leaf_module"] = {"classes": []}
    if not setup.resident:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return ds


def predicted(hw, row: dict) -> tuple[float, dict]:
    """(tokens/s, the step time's terms) of one report row under `hw`, on one GPU."""
    setup = parse_setup(row["setup"])
    policy = setup.ac if setup.trainer else "none"
    mb = row["micro_batch"]
    recipe = load_recipe(RECIPE, [f"train.micro_batch_size={mb}", f"activation_checkpointing.policy={policy}"])
    ds = setup_ds(load_ds_config(DS), setup)
    config = model_and_config(recipe)
    rates = sheet_rates(hw)
    seq = recipe.data.seq_len
    s = Setting(hw, 1, seq, mb * seq, 1 << 62, 1 << 62, model_flops_per_token(config, seq), rates)
    fam = make_family(recipe, ds, config, 1, 1, 1, setup.cpu_checkpointing, rates, memo=MEMO) or \
        make_family(recipe, ds, config, 1, 1, 1, False, rates, memo=MEMO)
    states = model_states(fam.profile, ds, fam.target)
    plan = plan_of(row, setup.cpu_checkpointing and setup.impl == "memtrain", config.num_hidden_layers)
    x = score(s, fam, config, ds, states, 3, False, False, mb, 1, plan)
    return x.tokens_per_s, x.time.terms


MEMO: dict = {}


def main(report_path: Path) -> None:
    rows = json.loads(report_path.read_text(encoding="utf-8"))["results"]
    sheet = load_hardware(SHEET)
    with tempfile.TemporaryDirectory() as tmp:
        cal = Path(tmp) / "h100-sxm-8x.yaml"
        write_calibration(report_path, cal)
        calibrated = load_hardware(SHEET, cal)
    print(f"efficiency.compute: sheet {sheet.compute_efficiency}, calibrated {calibrated.compute_efficiency} "
          f"({SETUP}'s MFU)\n")
    print("| set-up | plan | measured tokens/s | sheet | error | calibrated | error | terms (calibrated, ms) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        name = row["setup"]
        if name.startswith("torch:") and name != PLAIN or name.startswith("deepspeed:"):
            continue
        measured = row["tokens_per_s"]
        a, _ = predicted(sheet, row)
        b, terms = predicted(calibrated, row)
        note = " (in sample)" if name == SETUP else ""
        ms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in terms.items() if v)
        print(f"| {name} | `{row.get('plan') or ''}` | {measured:,.0f} | {a:,.0f} | {a / measured - 1:+.1%} | "
              f"{b:,.0f} | {b / measured - 1:+.1%}{note} | {ms} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPORT)

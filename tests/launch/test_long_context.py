"""Long sequences: the fused loss, tiled MLPs and Ulysses sequence parallelism.

Single-process tests compare memtrain's code with HF's own forward and loss (an independent
implementation) and measure peaks with torch's MemTracker. One launch with make train's launcher
and 2 gloo ranks (tests/long_context_worker.py) checks ZeRO-1/2/3, sequence parallelism,
tied embeddings and ignored labels against a plain-torch reference, then runs the trainer.
"""
import json

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import MAKE_TRAIN_LAUNCHER, ROOT, eval_loss_by_hand, launch_cmd, run_launch
from families import SP_GQA


def test_two_ranks_zero_stages_sequence_parallel_fused_tiled(tmp_path):
    """One launch: SP=2 vs one-rank full sequence for ZeRO-3/2/1 and with LoRA adapters, fused vs standard under
    ZeRO-3 with tied embeddings and ignored labels, slices vs DeepSpeed's adapter, then the trainer."""
    out = tmp_path / "cases.jsonl"
    proc = run_launch(launch_cmd(ROOT / "tests" / "long_context_worker.py", [str(out)], launcher=MAKE_TRAIN_LAUNCHER), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    for case in ("dp-fused-z3", "dp-standard-z3", "sp-fused-tiled-z3", "sp-standard-z2", "sp-fused-z1", "sp-lora-z3"):
        row = rows[case]
        assert abs(row["loss"] - row["ref_loss"]) < 1e-5, row
        assert row["grad_rel_err"] < 1e-5, row
        assert row["loss_used"] == ("standard" if "standard" in case else "fused"), row
    for family in SP_GQA:  # each family Ulysses runs (tests/families.py), 2 key/value heads
        row = rows[f"sp-{family}-z3"]
        assert abs(row["loss"] - row["ref_loss"]) < 1e-5 and row["grad_rel_err"] < 1e-5, row
    assert rows["slices-match-adapter"]["ranks_agreeing"] == 2.0
    summary = json.loads((tmp_path / "cases.jsonl.run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    m = summary["metrics"]
    # tokens counted once: one sequence-parallel group of 2 ranks reads 2 x 64 tokens per step
    assert m["throughput/tokens_per_s"] * m["time/step_s"] == pytest.approx(2 * 64, rel=1e-6)
    assert "sequence parallel: 2 ranks per sequence" in proc.stdout
    from memtrain.train import checkpoint
    assert checkpoint.has_checkpoint(tmp_path / "cases.jsonl.run" / "checkpoints")  # saved under the Ulysses mpu
    # the held-out loss under Ulysses (one data rank: 2 eval batches of 2 rows, each split over the 2 ranks) is
    # final/'s, computed by hand
    by_hand, positions = eval_loss_by_hand(tmp_path / "cases.jsonl.run" / "final", 64, 2 * 2)
    assert summary["eval_tokens"] == positions and abs(summary["eval_loss"] - by_hand) < 1e-5, (summary, by_hand)

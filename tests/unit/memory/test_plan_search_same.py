"""A fixed search ranks the same configurations as before the search was made faster: its ranked table, every scored
configuration's plan, peak, host bytes and step-time terms, and its drop counts, against
`plan_search_ranked.json`, written by the search of commit 0001edb (before the array solver and the shared memos) and
written again after the memory model's deliberate changes (ZeRO-0's all-reduce copy, ZeRO-3's persistent gathers:
commit df6d440; ZeRO-1/2's gradient accumulation terms in the search). A change to the memory or time model changes the table on purpose: check the new ranking, then write
the fixture again with `PYTHONPATH=src:tests python tests/unit/memory/test_plan_search_same.py` and say why in the commit.
A change that only makes the search faster must leave it as it is. In-process, on the tiny recipe: seconds."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT


H100 = ROOT / "hardware" / "h100-sxm-8x.yaml"
DS = ROOT / "ds_configs" / "zero3_ckpt.json"
FIXTURE = ROOT / "tests" / "unit" / "memory" / "plan_search_ranked.json"


def ranked(tmp_path) -> dict:
    """The fixed search: a GPU budget where half the configurations need the per-layer solver, a host link fast
    enough that some plans offload, a host budget that drops some offloads, and the top 3 re-scored on exact
    profiles. Everything its table and ranking show, as JSON."""
    import yaml

    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search
    from memtrain.tools.plan_search import format_search

    recipe = load_recipe(None, ["data.seq_len=64"])
    ds = load_ds_config(DS)
    ds["zero_optimization"].update(reduce_bucket_size=1e5, stage3_prefetch_bucket_size=1e5)
    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump({"source": "test", "gpu": {"memory": "0.006GiB", "host_gb_per_s": 5500}}))
    hw = load_hardware(H100, cal)
    result = search(recipe, ds, hw, 2, 64 * 16 * 4, host_budget=260 << 16, micro_batches=(1, 2, 4, 8), exact_top=3)
    return {"table": format_search(result, recipe, hw, 2, top=len(result.scored)).splitlines()[2:],
            "dropped": dict(sorted(result.dropped.items())),
            "scored": [{"config": x.config.label(), "layers": [str(c) for c in x.layers], "peak": x.peak,
                        "host_per_node": x.host_per_node, "phase": x.prediction.phase, "exact": x.exact,
                        "terms": x.time.terms, "counts": x.time.counts, "tokens_per_s": x.tokens_per_s,
                        "mfu": x.mfu} for x in result.scored]}


def test_a_fixed_search_ranks_as_before(tmp_path):
    """The same table line by line (its figures at their printed precision), the same configurations in the same
    order with the same plans, bytes and phases, each step-time term and tokens/s within 1e-12, the same drops."""
    now, before = ranked(tmp_path), json.loads(FIXTURE.read_text())
    assert now["dropped"] == before["dropped"]
    assert [x["config"] for x in now["scored"]] == [x["config"] for x in before["scored"]]
    for x, y in zip(now["scored"], before["scored"]):
        floats = ("terms", "counts", "tokens_per_s", "mfu")
        assert {k: v for k, v in x.items() if k not in floats} == {k: v for k, v in y.items() if k not in floats}
        assert x["terms"] == pytest.approx(y["terms"], rel=1e-12, abs=0), x["config"]
        assert x["counts"] == y["counts"]
        assert (x["tokens_per_s"], x["mfu"]) == pytest.approx((y["tokens_per_s"], y["mfu"]), rel=1e-12, abs=0)
    assert now["table"] == before["table"]
    assert len(now["scored"]) > 50 and sum(x["layers"] != ["keep"] * len(x["layers"]) for x in now["scored"]) > 20
    assert sum(any("offload" in c for c in x["layers"]) for x in now["scored"]) > 10


if __name__ == "__main__":  # write the fixture again (see the module's docstring: only for a deliberate model change)
    import tempfile
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        FIXTURE.write_text(json.dumps(ranked(Path(tmp)), indent=1) + "\n")
    print(f"written: {FIXTURE}")

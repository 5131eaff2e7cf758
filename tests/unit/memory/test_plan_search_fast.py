"""The search's fast mechanics change no answer: `memory.search.search` (memos shared across a family, solves reused
across ZeRO variants, the meta model built once) against a brute force written here that scores every
configuration on its own: a fresh copy of its family (nothing memoized), its own model states, its own
per-layer solve (or every layer kept where that fits), its own step time. In-process, on the tiny recipe: seconds."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from conftest import ROOT


H100 = ROOT / "hardware" / "h100-sxm-8x.yaml"
DS = ROOT / "ds_configs" / "zero3_ckpt.json"
MICRO_BATCHES = (1, 2, 4, 8)


def _one_by_one(recipe, ds: dict, hw, nodes: int, tokens: int, budget: int, host_budget: int):
    """(scored, dropped reasons): every configuration scored alone, in the order the rules are written in
    docs/planner-search.md (layout, activation offload, SP with ZeRO-0, host states, global batch, GPU memory,
    offload that offloads nothing, host with activations)."""
    from memtrain.memory import search as S
    from memtrain.memory.flops import model_flops_per_token
    from memtrain.memory.planner import activation_limit, choice_seconds, solve
    from memtrain.memory.plan_files import variant_ds
    from memtrain.memory.predict import LayerChoice, predict
    from memtrain.memory.score import Setting, make_family, score, sheet_rates
    from memtrain.memory.states import model_states
    from memtrain.memory.target import model_and_config

    world, config, rates = nodes * hw.gpus_per_node, model_and_config(recipe), sheet_rates(hw)
    s = Setting(hw, world, recipe.data.seq_len, tokens, budget, host_budget,
                model_flops_per_token(config, recipe.data.seq_len), rates)
    scored, dropped = [], Counter()
    for tp, sp, offload, reason in S.layouts(recipe, config, world, hw.gpus_per_node):
        family = None if reason else make_family(recipe, ds, config, world, tp, sp, offload, rates)
        for stage, offload_opt, offload_param in S.ZERO_VARIANTS:
            for mb in MICRO_BATCHES:
                if reason:
                    dropped[reason] += 1
                    continue
                if family is None:
                    dropped["activation offload: no layer can offload (needs full recompute)"] += 1
                    continue
                if sp > 1 and stage == 0:
                    dropped["SP with ZeRO-0 (Ulysses needs ZeRO >= 1)"] += 1
                    continue
                fam = replace(family)  # an empty memo: nothing shared with another configuration
                vds = variant_ds(fam.ds, stage, offload_opt, offload_param)
                states = model_states(fam.profile, vds, fam.target)
                if s.ranks_per_node * states.host > host_budget:
                    dropped["host RAM per node exceeded by the ranks' offloaded model states"] += 1
                    continue
                ga, rest = divmod(tokens, mb * recipe.data.seq_len * world // (tp * sp))
                if rest or ga < 1:
                    dropped["global batch not reachable (tokens not a multiple of micro-batch x seq x DP)"] += 1
                    continue
                states = model_states(fam.profile, vds, replace(fam.target, grad_accum=ga))  # what accumulating holds
                profile = fam.profile.scaled(mb) if mb != fam.profile.target.micro_batch_size else fam.profile
                keep = (LayerChoice("keep"),) * profile.num_layers
                plan = keep if predict(profile, states, keep).peak <= budget else solve(
                    profile, activation_limit(profile, states, fam.choices, budget), fam.choices,
                    {c: choice_seconds(profile, rates, c, fam.ops) for c in fam.choices}, backward_extra=states.backward,
                    reduction=states.reduction, release=states.release)
                if plan is None:
                    dropped["GPU memory exceeded (no per-layer plan fits)"] += 1
                    continue
                if offload and not any(c.offload for c in plan):
                    dropped["activation offload on, but no layer offloaded (same as off)"] += 1
                    continue
                x = score(s, fam, config, vds, states, stage, offload_opt, offload_param, mb, ga, plan)
                if x.host_per_node > host_budget:
                    dropped["host RAM per node exceeded by the ranks' offloads"] += 1
                    continue
                scored.append(x)
    return sorted(scored, key=S.rank_key), dropped


@pytest.mark.parametrize("host_budget", [None, 260 << 16])
def test_search_scores_every_configuration_as_alone(tmp_path, host_budget):
    """Same configurations scored, each with the same plan, peak bytes, host bytes and step time (1e-9), the
    same winner and the same count of every drop reason. A GPU budget where half the scored configurations need
    the per-layer solver, a host link fast enough that some plans offload, micro-batch 8 that cannot make the
    global batch on 8 ranks, and (second case) a host budget between what the offloaded states need and what
    they need with the offloaded activations."""
    import yaml

    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search

    recipe = load_recipe(None, ["data.seq_len=64"])
    ds = load_ds_config(DS)
    ds["zero_optimization"].update(reduce_bucket_size=1e5, stage3_prefetch_bucket_size=1e5)  # buckets that fit
    cal = tmp_path / "cal.yaml"
    cal.write_text(yaml.safe_dump({"source": "test", "gpu": {"memory": "0.006GiB", "host_gb_per_s": 5500}}))
    hw = load_hardware(H100, cal)
    fast = search(recipe, ds, hw, 1, 64 * 8 * 4, host_budget=host_budget, micro_batches=MICRO_BATCHES, exact_top=0)
    alone, dropped = _one_by_one(recipe, ds, hw, 1, 64 * 8 * 4, fast.budget, fast.host_budget)
    assert dict(fast.dropped) == dict(dropped)
    assert all(dropped[r] for r in ("global batch not reachable (tokens not a multiple of micro-batch x seq x DP)",
                                    "GPU memory exceeded (no per-layer plan fits)",
                                    "activation offload on, but no layer offloaded (same as off)"))
    assert host_budget is None or dropped["host RAM per node exceeded by the ranks' offloads"]
    assert len(alone) > 20 and [x.config for x in fast.scored] == [x.config for x in alone]
    for x, y in zip(fast.scored, alone):
        assert (x.layers, x.peak, x.host_per_node) == (y.layers, y.peak, y.host_per_node), x.config.label()
        assert x.time.seconds == pytest.approx(y.time.seconds, rel=1e-9, abs=0), x.config.label()
    assert sum(any(c.mode != "keep" for c in x.layers) for x in alone) > 20
    assert sum(any(c.offload for c in x.layers) for x in alone) > 10


def test_a_second_search_measures_no_profile_again(monkeypatch, tmp_path):
    """What the search caches across searches (the meta model, the profiles) leaves the next search's cache keys as
    they were: a second search in one process measures nothing on fake tensors, and answers the same. On 2 GPUs a
    node: TP 1 and 2, SP 2, each a family of its own measurement (8 GPUs add TP 4 and SP 4: the same keys, larger)."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory import profile
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search

    recipe = load_recipe(None, ["data.seq_len=48", "model.config.intermediate_size=80"])  # a model no test measured
    sheet = tmp_path / "h100-2x.yaml"
    sheet.write_text(H100.read_text().replace("gpus_per_node: 8", "gpus_per_node: 2"))
    args = (recipe, load_ds_config(DS), load_hardware(sheet), 1, 48 * 2 * 4)
    first = search(*args, micro_batches=(1, 2), exact_top=0)
    measured = []
    real = profile._measure_profile
    monkeypatch.setattr(profile, "_measure_profile", lambda *a, **k: measured.append(a) or real(*a, **k))
    second = search(*args, micro_batches=(1, 2), exact_top=0)
    assert not measured and {(x.config.tp, x.config.sp) for x in first.scored} == {(1, 1), (2, 1), (1, 2)}
    assert [(x.config, x.layers, x.peak) for x in first.scored] == [(x.config, x.layers, x.peak) for x in second.scored]

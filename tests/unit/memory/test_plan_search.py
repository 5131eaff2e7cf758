"""The whole-configuration search (`make plan --search`): hardware sheets, exact collective volumes, the step-time
terms, dropped configurations with their reasons, and the winner's written JSON + recipe, which preflight accepts
and whose memory is what `make plan` predicts for it. In-process, on the tiny recipe: seconds."""
from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from conftest import ROOT

from memtrain.errors import UserError


H100 = ROOT / "hardware" / "h100-sxm-8x.yaml"
DS = ROOT / "ds_configs" / "zero3_ckpt.json"


def _tiny(*overrides):
    from memtrain.config.recipe import load_recipe

    return load_recipe(None, ["data.seq_len=64", *overrides])


def _hardware(tmp_path: Path, **figures):
    """The H100 sheet with `figures` ("gpu.memory": "0.05GiB") from a calibration file."""
    from memtrain.memory.hardware import load_hardware

    cal: dict = {"source": "test"}
    for key, value in figures.items():
        section, name = key.split(".")
        cal.setdefault(section, {})[name] = value
    path = tmp_path / "cal.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cal))
    return load_hardware(H100, path)


def test_sheets_load_and_calibration_overrides(tmp_path):
    from memtrain.memory.hardware import load_hardware

    for sheet in sorted((ROOT / "hardware").glob("*.yaml")):
        hw = load_hardware(sheet)
        assert hw.gpus_per_node == 8 and hw.peak_flops > 1e14 and all(o == "sheet" for _, _, o in hw.figures())
    hw = _hardware(tmp_path, **{"gpu.host_gb_per_s": 40, "efficiency.compute": 0.5})
    assert hw.host_bytes_per_s == 40e9 and hw.flops_per_s == pytest.approx(989.4e12 * 0.5)
    origins = {k: o for k, _, o in hw.figures()}
    assert origins["gpu.host_gb_per_s"].endswith("cal.yaml") and origins["gpu.bf16_tflops"] == "sheet"
    bad = tmp_path / "bad.yaml"
    bad.write_text(H100.read_text().replace("bf16_tflops: 989.4", "bf16_tflops: fast"))
    with pytest.raises(UserError, match=r"bad.yaml: gpu.bf16_tflops: .*'fast'"):
        load_hardware(bad)
    (tmp_path / "cal2.yaml").write_text("gpu:\n  nvlink: 3\n")
    with pytest.raises(UserError, match=r"cal2.yaml: unknown key 'gpu.nvlink'"):
        load_hardware(H100, tmp_path / "cal2.yaml")


def _real_params(recipe) -> int:
    """Parameter elements of the model the trainer builds, counted on the meta model (independent of the profile)."""
    from memtrain.model.build import build_on_meta
    from memtrain.memory.target import model_and_config

    model = build_on_meta(recipe.model, model_and_config(recipe))
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_collective_volumes_equal_a_hand_count():
    from memtrain.memory.comm_volume import Layout, step_collectives
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.score import model_shape
    from memtrain.memory.target import make_target, model_and_config
    from memtrain.config.ds_config import load_ds_config

    recipe = _tiny()
    config = model_and_config(recipe)
    target = make_target(recipe, load_ds_config(DS), 4, device="cuda")
    profile = profile_activations(config, target)
    n = _real_params(recipe)
    shape = model_shape(config, profile, target, persistent=0)
    assert shape.params == n  # the profile's parameter count is the model's

    def total(colls, kind, group):
        return sum(c.bytes for c in colls if c.kind == kind and c.group == group)

    L, H, B, S = 4, 128, 8, 64  # the tiny model's layers and hidden size; a micro-step's batch and tokens
    z3 = step_collectives(shape, 3, 2, Layout(4, 8), B * S, ("keep",) * L)
    assert total(z3, "all_gather", "zero") == 2 * 2 * n  # forward + backward gathers of every bf16 parameter
    assert total(z3, "reduce_scatter", "zero") == 2 * n  # the gradients, once
    # recompute re-gathers nothing (leaf layers); a forward kept to the backward gathers once
    assert total(step_collectives(shape, 3, 2, Layout(4, 8), B * S, ("full",) * L), "all_gather", "zero") == 4 * n
    assert total(step_collectives(shape, 3, 2, Layout(4, 8), B * S, ("keep",) * L, 1), "all_gather", "zero") == 2 * n
    z1 = step_collectives(shape, 1, 2, Layout(4, 8), B * S, ("keep",) * L)
    assert [c.phase for c in z1] == ["step", "step"]  # ZeRO-1 reduces at the accumulation boundary only
    z2 = step_collectives(shape, 2, 2, Layout(4, 8), B * S, ("keep",) * L)
    assert [c.phase for c in z2] == ["micro", "step"]
    assert total(z2, "reduce_scatter", "zero") == 2 * n and total(z2, "all_gather", "zero") == 2 * n
    assert total(step_collectives(shape, 0, 2, Layout(4, 8), B * S, ("keep",) * L), "all_reduce", "zero") == 2 * n
    assert step_collectives(shape, 3, 2, Layout(1, 8), B * S, ("keep",) * L) == []  # a world of one talks to no one

    tp_shape = model_shape(config, profile, make_target(recipe, load_ds_config(DS), 4, device="cuda"), 0)
    tp = step_collectives(tp_shape, 3, 2, Layout(4, 8, tp=2), B * S, ("keep",) * L)
    # 2 forward (o, down) + 5 backward (the input gradients of q, k, v, gate, up) per layer
    assert total(tp, "all_reduce", "tp") == 7 * L * B * S * H * 2
    tp_full = step_collectives(tp_shape, 3, 2, Layout(4, 8, tp=2), B * S, ("full",) * L)
    assert total(tp_full, "all_reduce", "tp") == 9 * L * B * S * H * 2  # + a recomputed forward's 2

    # ZeRO-3 under AutoTP on one data-parallel rank: the replicated parameters (embedding, 2 norms a layer, the final
    # norm) reduce-scattered every micro-step and, every parameter persisting, gathered once a step over the TP ranks
    tp_ds = {**load_ds_config(DS), "tensor_parallel": {"autotp_size": 2}}
    tp2 = make_target(recipe, tp_ds, 2, device="cuda")
    tp2_shape = model_shape(config, profile_activations(config, tp2), tp2, 0)
    replicated = 4 * (config.vocab_size * H + (2 * L + 1) * H)  # fp32 bytes, counted from the config by hand
    one_rank = step_collectives(tp2_shape, 3, 4, Layout(2, 8, tp=2), B * S, ("keep",) * L, 1, True)
    assert [(c.kind, c.phase, c.bytes) for c in one_rank if c.group == "tp" and c.kind != "all_reduce"
            and "logits" not in c.what] == [("reduce_scatter", "micro", replicated), ("all_gather", "step", replicated)]
    assert not [c for c in step_collectives(tp2_shape, 2, 4, Layout(2, 8, tp=2), B * S, ("keep",) * L)
                if c.kind != "all_reduce" and "logits" not in c.what]  # ZeRO-2 keeps them whole: nothing moves

    heads, head_dim = 4, 32
    sp = step_collectives(shape, 3, 2, Layout(4, 8, sp=2), B * S // 2, ("keep",) * L)
    qkvo = 4 * B * (S // 2) * heads * head_dim * 2  # q, k, v and the output, this rank's slice, all heads
    assert total(sp, "all_to_all", "sp") == 2 * L * qkvo  # forward and backward
    sp_full = step_collectives(shape, 3, 2, Layout(4, 8, sp=2), B * S // 2, ("full",) * L)
    assert total(sp_full, "all_to_all", "sp") == 3 * L * qkvo
    # each attention's forward gathers the whole sequence's int64 position ids (a recomputed one again)
    assert total(sp, "all_gather", "sp") == L * B * S * 8 and total(sp_full, "all_gather", "sp") == 2 * L * B * S * 8
    # an untied LM head sharded over TP 2 gathers its logits padded to 2 x the larger rank's rows (257 -> 258)
    head = dataclasses.replace(tp_shape, vocab=257, sharded_head=True)
    assert total(step_collectives(head, 3, 2, Layout(4, 8, tp=2), B * S, ("keep",) * L), "all_gather", "tp") == \
        B * S * 258 * 2


def test_step_time_terms_by_hand(tmp_path):
    from memtrain.memory.comm_volume import MICRO, STEP, Collective, Layout
    from memtrain.memory.step_time import LATENCY_S, ZERO_OVERLAP, optimizer_seconds, step_time

    hw = _hardware(tmp_path)
    two_nodes = Layout(16, 8)  # the ZeRO group crosses nodes: the network's rate
    gather = Collective("all_gather", "zero", 8e9, 10, MICRO, "g")
    t = step_time(hw, two_nodes, [gather], model_flops=1e13, ac_seconds=0.0, grad_accum=2, optimizer_s=0.0)
    compute = 1e13 / (989.4e12 * 0.328)
    comm = 8e9 * 15 / 16 / (50e9 * 0.9) + 10 * LATENCY_S[True]
    assert t.terms["compute"] == pytest.approx(2 * compute)
    assert t.terms["zero_comm"] == pytest.approx(2 * max(comm - ZERO_OVERLAP * compute, 0))
    one_node = Layout(8, 8, tp=8)  # TP inside a node: NVLink, all-reduce 2(n-1)/n, never hidden
    ar = Collective("all_reduce", "tp", 1e9, 4, MICRO, "tp")
    step = Collective("all_reduce", "zero", 1e9, 1, STEP, "z0")
    t = step_time(hw, one_node, [ar, step], 1e13, 0.0, 3, 0.0)
    assert t.terms["tp_comm"] == pytest.approx(3 * (1e9 * 2 * 7 / 8 / (450e9 * 0.65) + 4 * LATENCY_S[False]))
    assert t.terms["zero_comm"] == 0.0  # a ZeRO group of 8 / tp 8 = 1 rank
    assert optimizer_seconds(hw, 10**9, False, 8) == pytest.approx(30e9 / (3350e9 * 0.9))
    assert optimizer_seconds(hw, 10**9, True, 8) == pytest.approx(8 * 30e9 / (614e9 * 0.5))
    assert t.terms["overhead"] == 0.0  # no overhead figures on the sheet

    # the overhead term: per layer forward-and-backward (a full recompute re-runs half), per collective call in a
    # group of more than one rank, per step; counted by hand
    hw = _hardware(tmp_path, **{"overhead.layer_s": 1e-3, "overhead.collective_s": 1e-4, "overhead.step_s": 0.05})
    dp2 = Layout(2, 8)
    micro = Collective("reduce_scatter", "zero", 1e6, 5, MICRO, "rs")
    t = step_time(hw, dp2, [micro, step, ar], 1e9, 0.0, 3, 0.0, modes=("keep", "full", "keep", "attn"))
    layers = 3 * (4 + 0.5 + 0.25)  # 3 micro-steps; full re-runs half a layer's calls, attn a quarter
    calls = 3 * 5 + 1  # the TP group is one rank: its calls cost nothing
    assert t.counts == {"layer_calls": layers, "collective_calls": calls, "steps": 1.0}
    assert t.terms["overhead"] == pytest.approx(1e-3 * layers + 1e-4 * calls + 0.05)

    # a CPU device (the CPU proxy's sheet) hides nothing: DeepSpeed's CPU accelerator has no side streams, so a
    # micro-step's reduce-scatter costs its bytes over the link and its latency even behind much more compute
    from memtrain.memory.hardware import load_hardware

    cpu = load_hardware(ROOT / "reports" / "readme" / "cpu-proxy" / "cpu-2.yaml")
    t = step_time(cpu, Layout(2, 2), [micro], model_flops=1e12, ac_seconds=0.0, grad_accum=2, optimizer_s=0.0)
    assert t.terms["compute"] > 100 * t.terms["zero_comm"] > 0
    assert t.terms["zero_comm"] == pytest.approx(2 * (1e6 / 2 / cpu.intra_bytes_per_s + 5 * LATENCY_S[False]))
    assert cpu.intra_bytes_per_s == 0.7e9  # gloo's measured rate (cpu-2.yaml), not the copy rate
    assert t.intra_bytes == 2 * 1e6 / 2  # what --verify fits the link's rate to: 2 micro-steps' reduce-scatter sent


def test_overhead_fit_is_the_best_non_negative_fit():
    """fit_overheads against known rates (exact data), and against a brute-force grid of non-negative rates where
    plain least squares would go negative: never worse than any grid point, never negative."""
    import itertools
    import random

    from memtrain.memory.overhead_fit import fit_overheads

    rng = random.Random(0)
    counts = [{"layer_calls": rng.choice((4, 8, 16, 32)), "collective_calls": rng.choice((0, 10, 40, 80)),
               "steps": 1.0} for _ in range(8)]
    truth = {"layer_s": 2e-3, "collective_s": 5e-4, "step_s": 0.1}
    exact = [2e-3 * c["layer_calls"] + 5e-4 * c["collective_calls"] + 0.1 for c in counts]
    assert fit_overheads(counts, exact) == pytest.approx(truth, rel=1e-9)
    skewed = [y - 2e-3 * c["collective_calls"] + rng.uniform(-0.01, 0.01) for y, c in zip(exact, counts)]
    fit = fit_overheads(counts, skewed)
    assert all(v >= 0 for v in fit.values()) and fit["collective_s"] == 0.0

    def err(rates):
        return sum((rates[0] * c["layer_calls"] + rates[1] * c["collective_calls"] + rates[2] - y) ** 2
                   for c, y in zip(counts, skewed))

    best = err((fit["layer_s"], fit["collective_s"], fit["step_s"]))
    grid = [i * 2e-4 for i in range(30)], [i * 1e-4 for i in range(10)], [i * 0.01 for i in range(30)]
    assert all(best <= err(g) + 1e-15 for g in itertools.product(*grid))

    # with each run's step seconds: the best fit of relative errors (a step 10x longer weighs no more)
    steps = [y + 0.05 * (1 + c["collective_calls"] / 10) for y, c in zip(skewed, counts)]

    def rel_err(rates):
        return sum(((rates[0] * c["layer_calls"] + rates[1] * c["collective_calls"] + rates[2] - y) / t) ** 2
                   for c, y, t in zip(counts, skewed, steps))

    rel = fit_overheads(counts, skewed, steps)
    rel_best = rel_err((rel["layer_s"], rel["collective_s"], rel["step_s"]))
    assert all(v >= 0 for v in rel.values()) and rel != fit
    assert all(rel_best <= rel_err(g) + 1e-15 for g in itertools.product(*grid))


def test_search_drops_what_cannot_run_with_its_reason(tmp_path):
    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.search import search

    recipe = _tiny("data.seq_len=126")  # 4 heads: TP 8 and SP 8 cannot split them; 126 tokens: SP 4 cannot
    hw = _hardware(tmp_path, **{"gpu.memory": "0.03GiB"})
    # 8 GPUs, 126 x 8 x 4 tokens: micro-batch 8 cannot make the global batch over 8 data-parallel ranks
    result = search(recipe, load_ds_config(DS), hw, 1, 126 * 8 * 4, host_budget=1 << 20, micro_batches=(1, 4, 8),
                    exact_top=3)
    reasons = dict(result.dropped)
    assert any(r.startswith("TP does not divide the attention heads (4)") for r in reasons), reasons
    assert any(r.startswith("SP does not divide the attention heads (4)") for r in reasons), reasons
    assert any(r.startswith("SP does not divide the sequence (126)") for r in reasons), reasons
    assert any(r.startswith("global batch not reachable") for r in reasons), reasons
    assert any(r.startswith("GPU memory exceeded") for r in reasons), reasons
    assert any(r.startswith("host RAM per node exceeded") for r in reasons), reasons  # 1 MiB: no offload fits
    assert result.scored and all(s.peak <= result.budget for s in result.scored)
    assert all(s.config.micro_batch * 126 * s.config.grad_accum * 8 // (s.config.tp * s.config.sp) == 126 * 8 * 4
               for s in result.scored)
    assert not any(s.config.offload_optimizer or s.config.offload_param for s in result.scored)


def test_written_plan_validates_and_its_memory_is_make_plans(tmp_path):
    """The winner's files pass preflight's checks, and `make plan`'s memory model gives the search's peak for them."""
    from memtrain.config.args import parse_args
    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.predict import predict
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.search import search
    from memtrain.memory.states import model_states
    from memtrain.memory.target import make_target, model_and_config
    from memtrain.tools.plan import plan_report
    from memtrain.tools.plan_search import write_plan
    from memtrain.train.preflight import resolve_run

    recipe = _tiny()
    for memory, check_make_plan in (("0.5GiB", True), ("0.012GiB", False)):  # everything kept; recompute needed
        # no host term: at the H100's 24 us an op, the tiny model's recompute costs more than any offload
        hw = _hardware(tmp_path, **{"gpu.memory": memory, "overhead.host_op_s": 0})
        result = search(recipe, load_ds_config(DS), hw, 1, 64 * 8 * 8, micro_batches=(2, 8), exact_top=3)
        best = result.scored[0]
        out = tmp_path / f"plan-{memory}"
        ds_path, recipe_path = write_plan(result, recipe, best, out)
        written, ds = load_recipe(str(recipe_path)), load_ds_config(ds_path)
        assert written.train.micro_batch_size == best.config.micro_batch
        assert written.train.grad_accum_steps == best.config.grad_accum
        assert written.parallel.sequence == best.config.sp
        assert ds["zero_optimization"]["stage"] == best.config.zero_stage
        if check_make_plan:  # preflight plans `policy: auto` for this machine (CPU: fp32), the plan is for GPUs (bf16)
            args = parse_args(["--deepspeed", str(ds_path), "--recipe", str(recipe_path), "--run-dir",
                               str(tmp_path / "run")])
            resolve_run(args, 8)  # raises UserError on anything preflight refuses
        target = make_target(written, ds, 8, device="cuda")
        profile = profile_activations(model_and_config(written), target).scaled(best.config.micro_batch)
        assert predict(profile, model_states(profile, ds, target), best.layers).peak == best.peak
        if check_make_plan:
            assert {str(c) for c in best.layers} == {"keep"}
            report = plan_report(written, ds, 8, "cuda", None)
            assert report["policies"]["keep"]["peak"] == best.peak
        else:
            assert any(c.mode != "keep" for c in best.layers)


def test_each_plan_is_the_solvers_under_a_tight_budget(tmp_path):
    """Every scored configuration's per-layer plan takes as little time as a fresh solve of its own limit
    (the search reuses solves across ZeRO variants), and fits; and as little as the fastest of every plan that
    fits (exhaustive, through the memory model alone: the solver's pruning and the search's memos change nothing)."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.planner import activation_limit, choice_seconds, solve
    from memtrain.memory.search import search

    ds = load_ds_config(DS)
    ds["zero_optimization"].update(reduce_bucket_size=1e5, stage3_prefetch_bucket_size=1e5)  # buckets that fit
    result = search(_tiny(), ds, _hardware(tmp_path, **{"gpu.memory": "0.006GiB"}), 1, 64 * 8 * 8,
                    micro_batches=(1, 2, 4, 8), exact_top=3)
    solved, walks = 0, {}
    for x in result.scored:
        fam = x.family
        profile = fam.profile if x.exact else fam.profile.scaled(x.config.micro_batch)
        seconds = {c: choice_seconds(profile, result.rates, c, fam.ops) for c in fam.choices}
        fresh = solve(profile, activation_limit(profile, x.states, fam.choices, result.budget), fam.choices, seconds,
                      backward_extra=x.states.backward, reduction=x.states.reduction,
                      release=x.states.release)
        if all(c.mode == "keep" for c in x.layers):
            continue
        solved += 1
        assert fresh is not None and x.peak <= result.budget
        assert sum(seconds[c] for c in x.layers) == pytest.approx(sum(seconds[c] for c in fresh), rel=1e-12, abs=1e-15)
        best = _fastest_of_every_plan(profile, x.states, fam.choices, seconds, result.budget,
                                      walks.setdefault((fam.tp, fam.sp, fam.activation_offload, x.exact), {}))
        assert sum(seconds[c] for c in x.layers) == pytest.approx(best, rel=1e-12, abs=1e-15), x.config.label()
    assert solved > 10


def _fastest_of_every_plan(profile, states, choices, seconds, budget, walks: dict) -> float:
    """The least time of every per-layer plan (the last layer not offloaded) whose peak under the memory model
    (memtrain.memory.predict, no solver) fits `budget`: the exhaustive answer the pruned, memoized search must
    match. `walks` caches the family's activation peaks per (micro-batch, reduce buffers, plan)."""
    import itertools

    from memtrain.memory.predict import predict

    best = float("inf")
    for plan in itertools.product(choices, repeat=profile.num_layers):
        if plan[-1].offload:
            continue
        key = (profile.target.micro_batch_size, states.backward_terms, plan)
        if key not in walks:
            pred = predict(profile, states, plan)
            walks[key] = (pred.activation_peak + pred.reduce_buffers - pred.released, pred.margin)
        act, margin = walks[key]
        if states.total + max(act, states.update) + margin <= budget:
            best = min(best, sum(seconds[c] for c in plan))
    return best


def test_ulysses_buffers_in_the_sp_profile():
    """An SP rank's profile carries two copies of its q, k, v beside what the same tokens without SP measure."""
    from dataclasses import replace

    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.target import make_target, model_and_config

    recipe = _tiny()
    config = model_and_config(recipe)
    plain = make_target(recipe, load_ds_config(DS), 2, device="cuda")
    sp = replace(plain, sequence_parallel=2)  # same tokens per rank (64), exchanged over 2 ranks
    a, b = profile_activations(config, plain), profile_activations(config, sp)
    qkv = 8 * 64 * 32 * (4 + 2 * 4) * 2  # micro-batch 8 x 64 tokens x head_dim 32 x (4 q + 4 k + 4 v heads), bf16
    for mode in a.layers:
        assert b.layers[mode].fwd_excess - a.layers[mode].fwd_excess == 2 * qkv
        assert b.layers[mode].bwd_excess - a.layers[mode].bwd_excess == 2 * qkv
        assert b.layers[mode].saved == a.layers[mode].saved


@pytest.mark.parametrize("argv, expected", [
    (["--search", "--nodes", "1", "--global-batch-tokens", "4096"],
     "--search: needs --hardware FILE, --nodes N and --global-batch-tokens T"),
    (["--search", "--hardware", "hardware/none.yaml", "--nodes", "1", "--global-batch-tokens", "4096"],
     "hardware/none.yaml: hardware sheet not found"),
    (["--search", "--hardware", str(H100), "--nodes", "0", "--global-batch-tokens", "4096"],
     "--nodes and --global-batch-tokens: must be positive"),
    (["--search", "--hardware", str(H100), "--nodes", "1", "--gpus-per-node", "9", "--global-batch-tokens", "4096"],
     f"--gpus-per-node: must be 1 to 8 ({H100}'s gpus_per_node)"),
    (["--search", "--hardware", str(H100), "--nodes", "1", "--global-batch-tokens", "4096", "--verify", "1",
      "--verify-extra", "-1"], "--verify-extra -1: must be >= 0"),
])
def test_search_flags_one_line(capsys, argv, expected):
    from memtrain.tools.plan import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code != 0 and err == [f"memtrain: error: {expected}"], err


def test_calibration_from_a_gpu_check_report(tmp_path, capsys):
    """gpu-check's memtrain:none MFU becomes the sheet's compute efficiency, marked as calibrated."""
    from memtrain.memory.hardware import load_hardware
    from memtrain.tools.plan import main

    report = tmp_path / "gpu.json"
    report.write_text(json.dumps({"title": "gpu-check llama-1b 1 GPU", "results": [
        {"setup": "torch:noac", "tokens_per_s": 44354.0},
        {"setup": "memtrain:none", "tokens_per_s": 36655.0, "mfu": 0.271, "measured_at": "2026-11-23 10:00"}]}))
    cal = tmp_path / "cal.yaml"
    cal.write_text("gpu:\n  host_gb_per_s: 52\n")  # a figure measured before stays
    main(["--calibrate-from", str(report), "--hardware", str(H100), "--calibration", str(cal)])
    hw = load_hardware(H100, cal)
    origin = {k: o for k, _, o in hw.figures()}
    assert hw.compute_efficiency == 0.271 and hw.host_bytes_per_s == 52e9
    assert origin["efficiency.compute"] == str(cal) and origin["gpu.bf16_tflops"] == "sheet"
    assert "memtrain:none, 2026-11-23 10:00" in cal.read_text()
    report.write_text(json.dumps({"results": [{"setup": "torch:noac", "tokens_per_s": 1.0}]}))
    with pytest.raises(SystemExit):
        main(["--calibrate-from", str(report), "--hardware", str(H100), "--calibration", str(cal)])
    assert "no measured 'memtrain:none' set-up" in capsys.readouterr().err


def test_faster_links_are_never_slower_and_one_rank_talks_to_no_one(tmp_path):
    """Metamorphic: every term of every scored configuration's step time is no larger on a sheet with faster links."""
    from dataclasses import replace

    from memtrain.memory.comm_volume import Layout, step_collectives
    from memtrain.memory.score import model_shape
    from memtrain.memory.step_time import step_time
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.target import make_target, model_and_config
    from memtrain.config.ds_config import load_ds_config

    recipe = _tiny()
    config = model_and_config(recipe)
    target = make_target(recipe, load_ds_config(DS), 16, device="cuda")
    shape = model_shape(config, profile_activations(config, target), target, 0)
    slow = _hardware(tmp_path)
    fast = replace(slow, intra_bytes_per_s=2 * slow.intra_bytes_per_s, inter_bytes_per_s=2 * slow.inter_bytes_per_s)
    for stage in range(4):
        for tp, sp in ((1, 1), (2, 1), (1, 2), (8, 1), (1, 16)):
            layout = Layout(16, 8, tp, sp)
            colls = step_collectives(shape, stage, 2, layout, 8 * 64 // sp, ("full", "keep") * 2)
            a, b = (step_time(hw, layout, colls, 1e9, 0.0, 4, 0.0).terms for hw in (slow, fast))
            assert all(b[k] <= a[k] for k in a) and a["compute"] == b["compute"], (stage, tp, sp, a, b)
            assert sum(a.values()) > a["compute"]  # something crossed a link
    alone = step_time(slow, Layout(1, 8), step_collectives(shape, 3, 2, Layout(1, 8), 512, ("keep",) * 4),
                      1e9, 0.0, 4, 0.0).terms
    assert alone["zero_comm"] == alone["tp_comm"] == alone["sp_comm"] == 0.0


def test_verify_picks_writes_runnable_sweeps_and_kendall_tau(tmp_path, monkeypatch):
    """--verify's parts without launching: the top K and seeded random others are picked; each becomes a one-point
    sweep the sweep runner loads, whose recipe and JSON are the configuration's; Kendall's tau-b equals the
    textbook formula from tie-group counts (an independent computation) on lists with ties."""
    import itertools
    import random
    from collections import Counter

    from memtrain.config.ds_config import load_ds_config
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.search import search
    from memtrain.tools.plan_verify import kendall_tau, pick, write_points
    from memtrain.tools.sweep_points import load_sweep, train_args

    result = search(_tiny(), load_ds_config(DS), _hardware(tmp_path, **{"gpu.memory": "0.5GiB"}), 1, 64 * 8 * 8,
                    micro_batches=(2, 8), exact_top=3)
    picks = pick(result.scored, 2, extra=3, seed=1)
    assert picks[:2] == [0, 1] and len(set(picks)) == 5 and all(i < len(result.scored) for i in picks)
    assert picks == pick(result.scored, 2, extra=3, seed=1)
    monkeypatch.chdir(tmp_path)
    for i, paths in write_points(result, _tiny(), picks, tmp_path / "plan", steps=4, repeats=2):
        assert len({load_sweep(p).points[0].run_dir for p in paths}) == 2  # each repeat its own run directory
        sweep = load_sweep(paths[0])
        (point,) = sweep.points
        # another configuration at the same rank (a changed ranking) gets another run directory
        assert result.scored[i].config.label().replace(" ", "-").replace(":", "-") in str(point.run_dir)
        args = train_args(sweep, point)
        assert sweep.spec.launcher.gpus_per_run == result.world and "train.max_steps=4" in args
        assert "train.save_checkpoints=false" in args, args  # a benchmark: no model checkpoint written
        written = load_recipe(sweep.spec.recipe)
        c = result.scored[i].config
        assert (written.train.micro_batch_size, written.train.grad_accum_steps, written.parallel.sequence) == (
            c.micro_batch, c.grad_accum, c.sp)
        assert load_ds_config(sweep.spec.deepspeed)["zero_optimization"]["stage"] == c.zero_stage

    def tau_b(xs, ys):
        n0 = len(xs) * (len(xs) - 1) / 2
        tied = lambda v: sum(t * (t - 1) / 2 for t in Counter(v).values())  # noqa: E731
        d = sum(1 for (x1, y1), (x2, y2) in itertools.combinations(zip(xs, ys), 2)
                if (x1 - x2) * (y1 - y2) < 0)
        c = sum(1 for (x1, y1), (x2, y2) in itertools.combinations(zip(xs, ys), 2) if (x1 - x2) * (y1 - y2) > 0)
        return (c - d) / ((n0 - tied(xs)) * (n0 - tied(ys))) ** 0.5

    rng = random.Random(0)
    for _ in range(50):
        xs = [rng.randint(0, 5) for _ in range(9)]
        ys = [rng.randint(0, 5) for _ in range(9)]
        assert kendall_tau(xs, ys) == pytest.approx(tau_b(xs, ys), abs=1e-12)
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_verify_fits_a_cpu_sheets_overhead_from_its_runs(tmp_path):
    """--verify's calibration on a CPU sheet: runs whose steps took the model's other terms plus known overheads
    (layer, collective call, step) give back those overheads in the calibration file, which then loads over the
    sheet; GPU runs do not calibrate a CPU sheet."""
    import shutil
    from dataclasses import replace

    import yaml

    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search
    from memtrain.tools.plan_verify import Verified, calibrate

    sheet = tmp_path / "cpu-2.yaml"
    shutil.copy(ROOT / "reports" / "readme" / "cpu-proxy" / "cpu-2.yaml", sheet)
    hw = load_hardware(sheet)
    assert hw.device == "cpu" and hw.overhead_layer_s == 0.0
    result = search(_tiny(), load_ds_config(DS), hw, 1, 64 * 16, micro_batches=(1, 16), exact_top=0)
    truth = {"layer_s": 2e-3, "collective_s": 4e-4, "step_s": 0.05}
    rows = []
    for i, s in enumerate(result.scored):
        c = s.time.counts
        seconds = s.time.seconds + truth["layer_s"] * c["layer_calls"] + truth["collective_s"] * c[
            "collective_calls"] + truth["step_s"]
        rows.append(Verified(s, i + 1, tmp_path, "completed", result.global_tokens / seconds, None, "cpu"))
    assert len({(r.scored.time.counts["layer_calls"], r.scored.time.counts["collective_calls"]) for r in rows}) >= 3
    cal = tmp_path / "calibration" / "cpu-2.yaml"
    assert calibrate([replace(r, device="cuda") for r in rows], sheet, cal) is None and not cal.exists()
    assert calibrate(rows, sheet, cal)
    assert yaml.safe_load(cal.read_text())["overhead"] == pytest.approx(truth, rel=1e-3)
    calibrated = load_hardware(sheet)  # the default calibration path
    assert (calibrated.overhead_layer_s, calibrated.overhead_collective_s, calibrated.overhead_step_s) == \
        pytest.approx((2e-3, 4e-4, 0.05), rel=1e-3)


def test_verify_repeats_run_interleaved_and_rank_ties_within_noise(tmp_path):
    """--verify-repeats: every configuration runs once per round, rounds alternating forward and back (positions
    summed over two rounds equal for every pick); each configuration's measured figure is the median of its runs
    (sorted()[1] of 3), read from run directories' summary.json as the runs write it; pairs whose runs' ranges
    overlap count as measured ties in the second tau, which equals tau-b on lists where those pairs are made equal
    by hand. No launch: 24 runs have no place in the suite, and the summaries are written in the trainer's format."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.search import search
    from memtrain.tools import plan_verify
    from memtrain.tools.sweep_points import RunDir

    order = plan_verify.run_order(4, 3)
    assert [p for j, p in order if j == 1] == [3, 2, 1, 0] and sorted(order) == [(j, p) for j in range(3)
                                                                                for p in range(4)]
    pos = {p: sum(k for k, (j, q) in enumerate(order) if q == p and j < 2) for p in range(4)}
    assert len(set(pos.values())) == 1

    result = search(_tiny(), load_ds_config(DS), _hardware(tmp_path, **{"gpu.memory": "0.5GiB"}), 1, 64 * 8 * 8,
                    micro_batches=(2, 8), exact_top=0)
    # three runs per configuration: (A) 100, 104, 96 -> 100; (B) 99, 103, 97 overlaps A; (C) 50, 51, 49; (D) 20, 22, 21
    runs = {0: [100, 104, 96], 1: [99, 103, 97], 2: [50, 51, 49], 3: [20, 22, 21]}
    rows = []
    for p, figures in runs.items():
        repeats = []
        for j, tokens_per_s in enumerate(figures):
            run_dir = tmp_path / f"runs/verify-{p}-r{j}"
            run_dir.mkdir(parents=True)
            RunDir(run_dir).summary_file.write_text(json.dumps(
                {"status": "completed", "device": "cpu", "metrics": {"throughput/tokens_per_s": tokens_per_s}}))
            repeats.append(plan_verify.measured(result, p, run_dir))
        rows.append(plan_verify.combined(repeats))
    assert [r.tokens_per_s for r in rows] == [sorted(runs[p])[1] for p in range(4)]
    assert rows[0].samples == (100, 104, 96) and rows[0].spread == pytest.approx(8 / 100)
    assert rows[0].overlaps(rows[1]) and not rows[1].overlaps(rows[2])
    text = plan_verify.format_verify(rows)
    predicted = [r.scored.tokens_per_s for r in rows]
    tied = [100, 100, 50, 20]  # A and B made equal by hand
    expected = plan_verify.kendall_tau(predicted, tied)
    assert "1 pairs within noise" in text and f"as measured ties: {expected:.2f}" in text
    assert "spread (max-min)/median" in text and "8.0%" in text


def test_search_on_fewer_gpus_than_the_sheets_node(tmp_path, capsys):
    """--gpus-per-node 1: one H100 of the 8-GPU sheet (a lent single GPU); the world is 1, so no configuration shards
    across ranks; of equal predicted tokens/s the larger micro-batch ranks first."""
    from memtrain.tools.plan import main

    out = tmp_path / "plan"
    main(["--search", "--hardware", str(H100), "--nodes", "1", "--gpus-per-node", "1", "--global-batch-tokens",
          str(64 * 2), "--set", "data.seq_len=64", "--json", "--out", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 1 and report["top"]
    assert all(c["config"]["tp"] == c["config"]["sp"] == 1 for c in report["top"])
    assert {c["config"]["micro_batch"] * c["config"]["grad_accum"] for c in report["top"]} == {2}
    assert (out / "ds.json").is_file()
    # one rank communicates nothing: micro-batch 1 x 2 and 2 x 1 tie in the model; the larger micro-batch ranks first
    # (measured faster on an H100: reports/readme/plan-verify-h100.md), whatever its peak
    first = [(c["tokens_per_s"], c["config"]["grad_accum"], c["peak"]) for c in report["top"]]
    tied = [x for x in first if x[0] == first[0][0]]
    assert {ga for _, ga, _ in tied} == {1, 2} and first == sorted(first, key=lambda x: (-x[0], x[1], x[2]))


def test_verify_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """After each run the table so far is in plans/<name>/verify/verify.md: a GPU lease that ends during the third
    run keeps the first two configurations' measured figures (2026-11-27: a cut call lost a whole table). The runs
    are stood in for by summaries in the trainer's format: a launch per run has no place in the suite."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.search import search
    from memtrain.tools import plan_verify
    from memtrain.tools.sweep_points import RunDir

    result = search(_tiny(), load_ds_config(DS), _hardware(tmp_path, **{"gpu.memory": "0.5GiB"}), 1, 64 * 8 * 8,
                    micro_batches=(2, 8), exact_top=0)
    monkeypatch.chdir(tmp_path)
    done = []

    def run(sweep, launcher=None):
        if len(done) == 2:
            raise KeyboardInterrupt  # the lease's time is up
        run_dir = sweep.points[0].run_dir
        run_dir.mkdir(parents=True)
        RunDir(run_dir).summary_file.write_text(json.dumps(
            {"status": "completed", "device": "cuda", "metrics": {"throughput/tokens_per_s": 1000.0 + len(done),
                                                                  "memory/peak_allocated_gib": 1.5}}))
        done.append(run_dir)

    monkeypatch.setattr(plan_verify, "run_sweep", run)
    with pytest.raises(KeyboardInterrupt):
        plan_verify.run_verify(result, _tiny(), tmp_path / "plan", 2, 4, None, 8, extra=1)
    table = (tmp_path / "plan" / "verify" / "verify.md").read_text().splitlines()
    assert table[0] == "2 of 3 runs done"
    rows = [line.split() for line in table[4:7]]  # the three picks, after the title and the header
    assert [r[0] for r in rows[:2]] == ["1", "2"] and [r[-5] for r in rows[:2]] == ["1,000", "1,001"], table
    assert [r[-1] for r in rows] == ["1.50", "1.50", "-"] and rows[2][-8:-6] == ["not", "run"], table

"""`make plan`: a recipe's predicted peak memory per device, by component and per AC policy, before any run.

`python -m memtrain plan` (`make plan RECIPE=... [DS=...] [BUDGET=40GiB] [NGPUS=...]`).

Activations are measured on fake tensors (nothing is allocated), so every shipped recipe plans
in seconds on a CPU. With a budget it adds, per policy, the largest micro-batch and the longest
sequence that fit, and the plan `policy: auto` would choose.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict, replace, replace as with_
from typing import Optional

from memtrain.recompute.policy import build_plan
from memtrain.errors import UserError, cli_entry
from memtrain.units import GIB, parse_size
from memtrain.model.eval_data import has_eval_data
from memtrain.model.moe import experts_line
from memtrain.memory.predict import LayerChoice, eval_peak, layer_paths, plan_choices, predict, predict_plan
from memtrain.memory.profile import MODULES, ActivationProfile, profile_activations
from memtrain.memory.rates import measure_rates
from memtrain.memory.states import model_states
from memtrain.memory.target import make_target, model_and_config, recompute_spec
from memtrain.tools.max_seq import format_max_seq, host_memory_bytes, largest, max_seq_report
from memtrain.tools.flags import plan_parser
from memtrain.memory.planner import (activation_limit, available_choices, choice_seconds, feasible, may_offload,
                                     predicted_plan, smallest_peak, what_fits)
from memtrain.config.ds_config import load_ds_config, zero_stage
from memtrain.config.ds_validate import check_tensor_parallel
from memtrain.config.recipe import ACSection, load_recipe
from memtrain.tools.plan_calibrate import run_calibrate

POLICY_OF = {"keep": "none", "op": "op", "attn": "selective:attn", "mlp": "selective:mlp", "full": "full",
             "full+offload": "full + cpu_checkpointing"}  # a LayerChoice as printed -> the policy it is


def profile_at_seq(p1: ActivationProfile, p2: ActivationProfile, seq_len: int) -> ActivationProfile:
    """Every activation size and FLOP count is a*S + b*S^2 in the sequence length S (attention
    scores and FLOPs carry S^2, the rest S): fitted through two measured lengths."""
    s1, s2 = p1.target.seq_len, p2.target.seq_len

    def fit(v1, v2):
        b = (v2 / s2 - v1 / s1) / (s2 - s1)
        a = v1 / s1 - b * s1
        v = a * seq_len + b * seq_len * seq_len
        return int(round(v)) if isinstance(v1, int) else v

    def fields(x1, x2):
        return {k: fit(v1, getattr(x2, k)) for k, v1 in asdict(x1).items() if isinstance(v1, (int, float))}

    layers = {m: replace(c, **fields(c, p2.layers[m])) for m, c in p1.layers.items()}
    scalars = {k: fit(getattr(p1, k), getattr(p2, k)) for k in
               ("outside_saved", "base", "head_excess", "head_net", "tail_excess", "largest_block")}
    return replace(p1, target=replace(p1.target, seq_len=seq_len), layers=layers, **scalars)


def _fits(profile: ActivationProfile, states, choices, budget: int, uniform: Optional[LayerChoice]) -> bool:
    if uniform is not None:
        return predict(profile, states, (uniform,) * profile.num_layers).peak <= budget
    return feasible(profile, activation_limit(profile, states, choices, budget), choices, *states.backward_terms) is not None


def plan_report(recipe, ds_config: dict, world_size: int, device: Optional[str], budget: Optional[int]) -> dict:
    spec = recompute_spec(recipe, ds_config, device, world_size)
    target = make_target(recipe, ds_config, world_size, spec=spec)
    config = model_and_config(recipe)
    profile = profile_activations(config, target)
    states = model_states(profile, ds_config, target)
    rates = measure_rates(target.dtype)
    choices = available_choices(profile, spec.backend, may_offload(spec, target, rates))
    report = _report_head(recipe, config, profile, target, ds_config, spec, rates, states, budget)
    long_profile = None
    if budget is not None:
        half = replace(target, seq_len=max(1, target.seq_len // 2))
        long_profile = (profile_activations(config, half), profile)
    max_pos = getattr(config, "max_position_embeddings", None) or 1 << 20
    extra_rows = _extra_rows(spec, profile.num_layers)
    for choice in (*choices, *extra_rows, "auto"):
        name = str(choice)  # a LayerChoice (uniform rows), an extra row's policy, or auto
        segments, notes = (), ()
        if name in extra_rows:
            plan = extra_rows[choice]
            pred = predict_plan(config, target, ds_config, plan)
            row_plan, segments, notes = plan_choices_of(config, target, plan), plan.segments, pred.notes
            uniform = None
            profile_row = profile_activations(config, target, (*profile.layers, *(
                c.mode for c in row_plan if c.mode.startswith(MODULES))))
        elif name == "auto":
            if budget is None:
                continue
            result = predicted_plan(profile, states, choices, rates, budget)
            if result is None:
                peak, hint = what_fits(profile, ds_config, target, choices, budget)
                report["auto"] = {"fits": False, "smallest_peak_gib": peak, "would_fit": hint}
                row_plan = smallest_peak(profile, choices, *states.backward_terms)[1]
            else:
                report["auto"] = {"fits": True, "layers": [str(c) for c in result.layers], "seconds": result.seconds}
                row_plan = result.layers
            uniform = None
        else:
            row_plan, uniform = (choice,) * profile.num_layers, choice
        if name not in extra_rows:
            profile_row = profile
            pred = predict(profile, states, row_plan)
        # a segment recomputes each of its layers once, as full layers do (the time model has no segments)
        seconds = sum(choice_seconds(profile_row, rates, c) for c in row_plan) if not segments else None
        flops = sum(profile_row.layers[c.mode].recompute_flops for c in row_plan)
        row = _policy_row(POLICY_OF.get(name, name), pred, flops, seconds, notes)
        if budget is not None and name in extra_rows:
            row["fits"] = pred.peak <= budget
            row["max_micro_batch"] = row["max_seq_len"] = None
            report["policies"][name] = row
            continue
        if budget is not None:
            row["fits"] = pred.peak <= budget if uniform else report["auto"]["fits"]
            row["max_micro_batch"] = largest(lambda mb: _fits(profile.scaled(mb), states, choices, budget, uniform),
                                              1, 4096)
            row["max_seq_len"] = largest(lambda s: _fits(profile_at_seq(*long_profile, s), states, choices,
                                                          budget, uniform), 1, max_pos)
        report["policies"][name] = row
    return report


def _report_head(recipe, config, profile, target, ds_config: dict, spec, rates, states, budget) -> dict:
    """The report's fields that do not depend on the policy: the model, the target, the rates and the model states."""
    return {
        "recipe": recipe.name, "data_format": recipe.data.format, "model_type": config.model_type,
        "num_layers": profile.num_layers,
        "hidden_size": config.hidden_size, "num_params": profile.num_params, "target": target.to_dict(),
        "zero_stage": zero_stage(ds_config), "ac_backend": spec.backend, "rates": rates.to_dict(),
        "rates_note": ("measured on this machine's GPU" if rates.device == target.device == "cuda" else
                       f"measured on this machine's {rates.device}; the step-time ranking is "
                       + ("for it" if rates.device == target.device else "not measured on GPU")),
        "model_states": {**asdict(states), "total": states.total},
        "policies": {}, "budget": budget,
        "allocator_margin_note": "measured as 0 on an H100 (memory.predict.ALLOCATOR_MARGIN)",
        "experts": experts_line(config, target.dtype),
        "packed_mask": target.micro_batch_size * target.seq_len ** 2 if target.packed else None,  # bool elements
        # held-out eval (data.eval_paths): one no-grad forward per eval micro-batch
        "eval_peak": eval_peak(profile, states) if has_eval_data(recipe.data) else None,
        "compile": (None if recipe.train.compile is False else
                    "train.compile: compiled layers' figures (what each compiled forward saves, as inductor's "
                    "partitioner splits the layer)" if target.compiled else
                    "train.compile auto: eager layers' figures; the run decides, and predicts compiled layers where "
                    "it compiles"),
    }


def _policy_row(policy: str, pred, flops: float, seconds: Optional[float], notes) -> dict:
    """One policy's row of the report from its prediction."""
    return {"policy": policy, "saved_per_layer": pred.saved_per_layer,
            "saved_activations": pred.saved_activations, "recompute_working_set": pred.recompute_working_set,
            "logits_and_loss": pred.logits_and_loss, "activation_peak": pred.activation_peak,
            "prefetched": pred.prefetched, "side_stream": pred.side_stream,
            "reduce_buffers": pred.reduce_buffers, "margin": pred.margin, "peak": pred.peak,
            "phase": pred.phase, "peak_at": pred.peak_at, "recompute_flops": flops, "extra_seconds": seconds,
            "notes": list(notes)}


def _extra_rows(spec, num_layers: int) -> dict:
    """Rows beside the uniform per-layer modes: sqrt segments, and the recipe's own policy where
    it is none of the rows (modules patterns, every:K, first:N, ...), each under the run's spec."""
    # sqrt with the default segment length, whatever the recipe's own policy keys say
    sqrt = ACSection(policy="sqrt")
    rows = {"sqrt": build_plan(with_(spec, ac_policy=sqrt.policy, partition_activations=False, section=sqrt),
                               num_layers)}
    policy = spec.policy
    if policy not in ("auto", "none", "full", "sqrt", "op", "selective:attn", "selective:mlp"):
        try:
            rows[policy] = build_plan(spec, num_layers)
        except UserError:  # the run's own check says why; the table goes on without it
            pass
    return rows


def plan_choices_of(config, target, plan) -> tuple[LayerChoice, ...]:
    return plan_choices(plan, layer_paths(config, target), config.num_hidden_layers)[0]


def format_report(r: dict) -> str:
    return "\n".join([*_summary_lines(r), *_policy_table(r)])


def _summary_lines(r: dict) -> list:
    """The report's head: the model, the target, how it was measured and the model states per device."""
    t = r["target"]
    ms = r["model_states"]
    g = lambda b: f"{b / GIB:.3f}"  # noqa: E731
    lines = [
        f"memtrain plan: recipe {r['recipe']} ({r['model_type']}, {r['num_layers']} layers, hidden "
        f"{r['hidden_size']}, {r['num_params'] / 1e9:.3f} B params); micro-batch {t['micro_batch_size']} x seq "
        f"{t['seq_len']}, {t['dtype']} on {t['device']}, {t['world_size']} device(s), ZeRO stage {r['zero_stage']}"
        + (f", tensor parallel {t['tp']} (one rank's shards; ZeRO over {t['world_size'] // t['tp']} data-parallel "
           f"rank(s); checkpointed inputs {'partitioned' if t['partition'] else 'not partitioned'})"
           if t.get("tp", 1) > 1 else ""),
        "activations measured on fake tensors, one decoder layer per mode, scaled by the layer count; "
        f"rates {r['rates_note']}",
        *([r["experts"]] if r.get("experts") else []),
        *([f"packed rows (data.format {r['data_format']}): sdpa/eager attention keeps samples apart with a "
           f"(micro-batch, 1, S, S) mask of {r['packed_mask'] / GIB:.3f} GiB, and each layer's attention keeps its own "
           "copy for backward (measured: in base and saved/layer); model.config.attn_implementation="
           "flash_attention_2 (GPU) builds none"] if r.get("packed_mask") else []),
        *([r["compile"]] if r.get("compile") else []),
        "",
        f"model states per device: {g(ms['total'])} GiB = parameters {g(ms['params'])} + gradients {g(ms['grads'])}"
        f" + optimizer states {g(ms['optimizer'])}"
        + (f" + one 4-bit weight dequantized for its matmul {g(ms['dequantized'])} (parameters: the 4-bit base at "
           "half a byte a weight and its quant state)" if ms.get("dequantized") else "")
        + (f" + ZeRO-3 reduce bucket {g(ms['buckets'])} + persistent parameters {g(ms['persistent'])}"
           f" + gathered parameters {g(ms['gathered'])}" if r["zero_stage"] == 3 else "")
        + (f"; in the backward: ZeRO-{r['zero_stage']} reduce buckets {g(ms['reduce_buckets'])}"
           f" + reduce scratch {g(ms['reduce_scratch'])}" if ms["reduce_buckets"] or ms["reduce_scratch"] else "")
        + (f"; the update's gradients {g(ms['update'])} (optimizer step, no activations then"
           + (": one sub group flat and in fp32)" if r["zero_stage"] == 3 else ": fp32)") if ms["update"] else "")
        + (f"; on host: {g(ms['host'])}" if ms["host"] else ""),
        "",
    ]
    return lines


def _policy_table(r: dict) -> list:
    """One row per policy (and auto): the activation terms, the peak, the recompute cost and what fits."""
    t = r["target"]
    g = lambda b: f"{b / GIB:.3f}"  # noqa: E731
    lines = []
    head = ["policy", "saved/layer", "saved", "recompute ws", "logits+loss", "act. peak", "prefetch", "ZeRO bufs",
            "margin", "peak GiB", "peak at", "recompute TFLOP", "extra ms"]
    budget = r["budget"]
    if budget is not None:
        head += ["fits", "max micro-batch", "max seq"]
    rows, notes = [], []
    for choice, p in r["policies"].items():
        per_layer = "mixed" if len(p["saved_per_layer"]) > 1 else g(next(iter(p["saved_per_layer"].values())))
        row = [p["policy"], per_layer, g(p["saved_activations"]), g(p["recompute_working_set"]),
               g(p["logits_and_loss"]), g(p["activation_peak"]), g(p["prefetched"] + p["side_stream"]),
               g(p["reduce_buffers"]), g(p["margin"]), g(p["peak"]), p["peak_at"],
               f"{p['recompute_flops'] / 1e12:.3f}",
               f"{p['extra_seconds'] * 1e3:.1f}" if p["extra_seconds"] is not None
               and r["rates"]["device"] == t["device"] else "-"]
        if budget is not None:
            row += ["yes" if p["fits"] else "no", str(p["max_micro_batch"] or "-"), str(p["max_seq_len"] or "-")]
        rows.append(row)
        notes += [f"{p['policy']}: {n}" for n in p.get("notes", ())]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i in (0, 10) else str(c).rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows]
    lines.append("(GiB per device; 'auto' is the per-layer plan of policy: auto; 'sqrt' segments of ~sqrt(L) "
                 "layers; recompute TFLOP per micro-step, measured; prefetch = offloaded inputs restored ahead "
                 "(and held by the side-stream copy) at the peak, in act. peak; ZeRO bufs = ZeRO-1/2 reduce buckets "
                 "at the peak; margin = allocator margin (measured as 0 on an H100); extra ms = "
                 "predicted recompute and exposed offload time per micro-step, shown when the rates were measured "
                 "on the target device)")
    lines += [f"note: {n}" for n in notes]
    if r.get("eval_peak") is not None:
        lowest = min(p["peak"] for p in r["policies"].values())
        lines.append(f"eval (train.eval_every: one no-grad forward per eval micro-batch, nothing saved): peak "
                     f"{g(r['eval_peak'])} GiB, below every policy's training peak (lowest {g(lowest)})"
                     if r["eval_peak"] <= lowest else
                     f"eval: peak {g(r['eval_peak'])} GiB, ABOVE the lowest training peak {g(lowest)}")
    if budget is not None:
        auto = r["auto"]
        if auto["fits"]:
            marks = " ".join({"keep": ".", "op": "O", "attn": "A", "mlp": "M", "full": "R"}.get(c, "H")
                             for c in auto["layers"])
            lines.append(f"auto under {budget / GIB:g} GiB: {marks}  (. keep, O op, A attn, M mlp, R full, "
                         "H full + offload)")
        else:
            lines.append(f"nothing fits {budget / GIB:g} GiB: smallest achievable peak {auto['smallest_peak_gib']:.3f}"
                         f" GiB; would fit: {auto['would_fit']}")
    return lines


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = plan_parser().parse_args(argv)
    if args.ngpus < 1:
        raise UserError(f"--ngpus: must be positive (got {args.ngpus})")
    budget = parse_size(args.budget, "--budget") if args.budget else None
    recipe = load_recipe(args.recipe, args.overrides)
    ds_config = load_ds_config(args.deepspeed)
    if args.calibrate_from:
        run_calibrate(args)
        return
    if args.search:
        from memtrain.tools.plan_search import run_search  # noqa: PLC0415 --search only: the search loads memory.flops (transformers, torch._dynamo: seconds)
        from memtrain.tools.plan_verify import check_verify_args, verify_cli  # noqa: PLC0415 --search only: the search loads memory.flops (transformers, torch._dynamo: seconds)

        check_verify_args(args, recipe.train.metric_warmup_steps)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep it for the result
            import deepspeed  # noqa: F401, PLC0415 deepspeed: heavy, only --search needs it (its import-time log lines)
        result, hw, out = run_search(args, recipe, ds_config)
        if args.verify:
            verify_cli(args, result, recipe, hw, out)
        return

    check_tensor_parallel(ds_config, args.deepspeed, model_and_config(recipe), args.ngpus)
    if args.max_seq:
        if budget is None:
            raise UserError("--max-seq: needs --budget (make plan BUDGET=80GiB ARGS=--max-seq)")
        host = parse_size(args.host_budget, "--host-budget") if args.host_budget else host_memory_bytes()
        with contextlib.redirect_stdout(sys.stderr):
            report = max_seq_report(recipe, ds_config, args.ngpus, args.device, budget, host)
        print(json.dumps(report, indent=2) if args.json else format_max_seq(report))
        return
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; keep it for the result
        report = plan_report(recipe, ds_config, args.ngpus, args.device, budget)
    print(json.dumps(report, indent=2) if args.json else format_report(report))


if __name__ == "__main__":
    main()

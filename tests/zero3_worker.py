"""Launcher script for test_zero3_hooks: the trainer's own engine set-up on 2 gloo ranks, ZeRO-3, the tiny
Llama, with DeepSpeed's hooks and collectives counted (memtrain.train.zero3_probe).

Run by `deepspeed --num_gpus 2 tests/zero3_worker.py OUT_DIR`. For each case (JSON variant, policy,
backend) it validates and builds exactly as `src/train.py` does (resolve_run -> resolve_ds_config + the
ZeRO-3 layout -> build_engine; rank 0 resolves first and measures the activation profiles into OUT_DIR/cache,
the other rank reads them, as a run's ranks read its preflight's), runs steps on seeded random tokens and
records, per step, what the probe counted. Rank 0 also records every parameter's full gradient after the first backward
(`deepspeed.utils.safe_get_full_grad`, a collective on all ranks). Writes OUT_DIR/rank<r>.json, and rank 0's
gradients (and LoRA's plain-peft reference gradients) as tensors into OUT_DIR/grads0.pt, in the cases' order.

JSON variants: "leaf" is ds_configs/zero3_ckpt_no_offload.json (memtrain makes the decoder layers
ZeRO-3 leaf modules); "hooked" adds `zero_optimization.leaf_module: {classes: []}`, so DeepSpeed hooks
every submodule as it does by default. "frozen" and "trainable" are "leaf" with the recipe's
train.frozen / train.trainable (memtrain.model.freeze; FREEZE below); for them each rank also records
whether every frozen parameter is bit-identical after the steps and how many elements DeepSpeed's
optimizer holds. "offload" and "offload-compiled" are "leaf" (and "compiled") with the JSON's cpu_checkpointing on and
the recompute spec resolved as on a GPU (`as_on_a_gpu`), so memtrain's offload runs under ZeRO-3. Then each family
of tests/families.py: its engine's initial weights against a plain build's, and 3 steps. Last, Ulysses sequence parallelism on the multi-head families (tests/families.py SP_MHA):
their gradients against one full-sequence rank, into OUT_DIR/sp<r>.json.
"""
import contextlib
import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from conftest import compiled_calls

ROOT = Path(__file__).resolve().parents[1]
# MEMTRAIN_TEST_TIMING=DIR: each rank writes DIR/timing<r>.json: [wall s, this process's CPU s, count] by phase
TIMES = defaultdict(lambda: [0.0, 0.0, 0])


@contextlib.contextmanager
def timed(key: str):
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        entry = TIMES[key]
        entry[0] += time.perf_counter() - wall
        entry[1] += time.process_time() - cpu
        entry[2] += 1
        if os.environ.get("MEMTRAIN_TEST_TIMING"):  # written after each phase: a killed run leaves its table
            dump_times()


def dump_times():
    rank = os.environ.get("RANK", "0")
    (Path(os.environ["MEMTRAIN_TEST_TIMING"]) / f"timing{rank}.json").write_text(json.dumps(TIMES, indent=0))
# counter cases: steps 0-1 warm DeepSpeed's trace, 2-4 are the steady state the tests compare, and a leak of one
# entry per step shows in 4 differences
STEPS = 5
GRAD_POLICIES = ("none", "full", "every:2", "sqrt", "selective:attn", "selective:mlp", "op", "modules")
# (variant, policy, backend, steps): counter cases run STEPS steps, gradient cases one backward
CASES = [("leaf", "none", "auto", STEPS), ("leaf", "full", "torch", STEPS), ("leaf", "full", "deepspeed", STEPS),
         ("leaf", "op", "auto", STEPS), ("hooked", "full", "auto", STEPS), ("hooked", "full", "torch", STEPS)]
# (leaf, full, auto) is (leaf, full, torch) on a CPU: test_zero3_hooks compares the latter's gradients
CASES += [(v, p, "auto", 1) for p in GRAD_POLICIES for v in ("leaf", "hooked")
          if (v, p, "auto", STEPS) not in CASES and (v, p) != ("leaf", "full")]
# compositions and a sublayer on DeepSpeed's checkpoint (the trainer itself runs sqrt: tests/launch/test_ac_policies.py)
COMPOSED = (("op+first:2", "auto"), ("selective:mlp", "deepspeed"))
CASES += [("leaf", p, b, 1) for p, b in COMPOSED]
# frozen embedding (the first layer's input then needs no grad: DeepSpeed's reentrant checkpoint would give its
# layer no gradient) and attention; or only the MLPs train
FREEZE = {"frozen": "train.frozen=[model.embed_tokens.*,*.self_attn.*]", "trainable": "train.trainable=[*.mlp.*]",
          "lora": "model.lora.r=4"}
CASES += [("frozen", "none", "auto", 3), ("frozen", "full", "torch", 3), ("frozen", "full", "deepspeed", 3),
          ("frozen", "sqrt", "auto", 3), ("trainable", "op", "auto", 3)]
# LoRA adapters (peft) under ZeRO-3: gradients against a plain peft model without DeepSpeed (rank 0 computes it)
CASES += [("lora", p, b, 1) for p, b in (("none", "auto"), ("full", "torch"), ("full", "deepspeed"), ("op", "auto"))]
# train.compile: each policy's layers compiled, STEPS_COMPILED steps (2 may compile, the rest must not), gradients
# and losses against the eager "leaf" run of the same policy
COMPILED = (("none", "auto"), ("full", "torch"), ("full", "deepspeed"), ("every:2", "auto"),
            ("selective:attn", "auto"), ("op", "auto"))
STEPS_COMPILED = 4
CASES += [("compiled", p, b, STEPS_COMPILED) for p, b in COMPILED]
CASES = [(v, p, b, max(n, STEPS_COMPILED) if v == "leaf" and (p, b) in COMPILED else n) for v, p, b, n in CASES]
CASES = [(v, p, b, STEPS if (v, p, b) == ("leaf", "sqrt", "auto") else n) for v, p, b, n in CASES]  # offload's peer
# lower stages build the model without zero.Init (other initial weights): each has its own all-trainable reference
CASES += [(f"{v}-z{stage}", p, b, n) for stage in (0, 1, 2)
          for v, p, b, n in (("frozen", "full", "deepspeed", 3), ("plain", "none", "auto", 1))]
# memtrain's cpu_checkpointing as a GPU run has it (the JSON's key in effect: see `as_on_a_gpu`), with leaf layers:
# backend auto (DeepSpeed's reentrant checkpoint, gpu-check's memtrain:full+offload), torch's checkpoint, sqrt
# segments (hooked submodules inside), and compiled layers (memtrain:full+offload+compile)
OFFLOAD = (("offload", "full", "auto", STEPS), ("offload", "full", "torch", STEPS), ("offload", "sqrt", "auto", STEPS),
           ("offload-compiled", "full", "auto", STEPS_COMPILED))
CASES += list(OFFLOAD)


def timed_range(key: str, n: int):
    with timed(key):
        yield from range(n)


def settle_garbage():
    """The engines this process built so far collected, and what lives on frozen out of the collector's sight.
    DeepSpeed's ZeRO-3 runs a full gc.collect() in every engine's set-up (its defragment): with the hundreds of
    thousands of objects of torch, transformers and DeepSpeed frozen, that collect scans the new engine only
    (measured: 0.2 CPU-s a collect before, microseconds after). A run builds one engine: this is the test's cost."""
    gc.collect()
    gc.freeze()


def json_for(variant: str, out_dir: Path, rank: int) -> str:
    raw = json.loads((ROOT / "ds_configs" / "zero3_ckpt_no_offload.json").read_text())
    raw.pop("tensorboard", None)
    if variant == "hooked":
        raw["zero_optimization"]["leaf_module"] = {"classes": []}
    if variant.startswith("offload"):
        raw["activation_checkpointing"]["cpu_checkpointing"] = True
    if "-z" in variant:  # frozen-z0/1/2: the same freezing under a lower ZeRO stage
        raw["zero_optimization"] = {"stage": int(variant.rpartition("-z")[2])}
    path = out_dir / f"ds-{variant}-rank{rank}.json"  # each rank its own: no rank reads a half-written file
    path.write_text(json.dumps(raw))
    return str(path)


def run_case(variant, policy, backend, steps, out_dir, rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from memtrain.config.args import parse_args
    from memtrain.config.ds_config import model_hidden_size, resolve_ds_config
    from memtrain.model.build import decoder_layers
    from memtrain.recompute.compiled import CompileWatch
    from memtrain.recompute.meter import ActivationMeter
    from memtrain.train.preflight import resolve_run
    from memtrain.train.trainer import COMPILE_WARMUP_STEPS, build_engine
    from memtrain.train.zero3_probe import Zero3Probe

    overrides = ["data.seq_len=32", "train.micro_batch_size=2", "data.random_tokens=true", "train.grad_clip=0",
                 f"data.cache_dir={out_dir / 'cache'}",
                 f"activation_checkpointing.policy={policy}", f"activation_checkpointing.backend={backend}",
                 "activation_checkpointing.modules=[model.layers.*.mlp]",
                 f"train.compile={variant in ('compiled', 'offload-compiled')}"] + ([FREEZE[variant.partition("-")[0]]] if variant.partition("-")[0] in FREEZE else [])
    tag = f"case {variant}/{policy}/{backend}"
    args = parse_args(["--deepspeed", json_for(variant, out_dir, rank), *sum((["--set", o] for o in overrides), [])])
    with timed(f"{tag}: resolve"), as_on_a_gpu() if variant.startswith("offload") else contextlib.nullcontext():
        checked = resolve_run(args, world)  # one rank measures its profiles, the other waits and reads them
    plan = checked.plan
    ds_config = checked.zero3.apply(resolve_ds_config(args.ds_config, args.recipe, world, out_dir / "run",
                                                      plan.checkpoint_calls, hidden_size=model_hidden_size(checked.config)))
    with timed(f"{tag}: build_engine"):
        engine, _, _, _ = build_engine(args.recipe, checked.config, plan, ds_config, args.ds_config, checked.spec,
                                       compiled=checked.compile.on)
    compiles = CompileWatch()
    with timed(f"{tag}: reference"):
        reference = _plain_peft_grads(engine.module, args.recipe, checked.config, world, rank) if variant == "lora" else None
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in frozen]):  # a collective: every rank
        before = {n: p.detach().clone() for n, p in frozen}
    probe = Zero3Probe(engine.module, list(decoder_layers(engine.module)[1])).__enter__()
    torch.manual_seed(100 + rank)
    grads, losses, compiled = {}, [], None
    profiled = rank == 0 and (variant == "compiled" or (variant == "leaf" and (policy, backend) in COMPILED))
    # the activation meter (a dispatch mode on every op) where test_zero3_hooks reads its bytes: rank 0's compiled
    # cases, their eager peers and the compositions against no recompute
    metered = rank == 0 and (variant == "compiled" or (variant == "leaf" and (policy, backend) in COMPILED + COMPOSED))
    activation_bytes = None
    try:
        for step in range(steps):
            ids = torch.randint(0, checked.config.vocab_size, (2, 32))
            timer = timed(f"{tag}: step {min(step, 2)}{'+' if step >= 2 else ''}")
            timer.__enter__()
            meter = ActivationMeter()
            # step 1 profiled: calls into compiled code (after step 0 compiled), forward, recompute and backward; on
            # rank 0, of the compiled cases and their eager peers (what test_zero3_hooks compares)
            with profile(activities=[ProfilerActivity.CPU]) if step == 1 and profiled else contextlib.nullcontext() as prof:
                with meter.measure() if step == 0 and metered else contextlib.nullcontext():
                    loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            if step == 0 and metered:
                activation_bytes = meter.bytes
            if step == 1 and profiled:
                compiled = compiled_calls(prof)
            losses.append(loss.item())
            if step == 0:  # every rank takes part in the gather
                with timed(f"{tag}: full grads"):
                    full = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
                    if rank == 0:
                        grads = {n: g.detach().clone() for n, g in full.items() if g is not None}
            engine.step()
            probe.step_done(engine)
            compiles.step_done(step, warmed_up=step >= COMPILE_WARMUP_STEPS)
            timer.__exit__(None, None, None)
    finally:
        probe.__exit__(None, None, None)
    with deepspeed.zero.GatheredParameters([p for _, p in frozen]):
        changed = [n for n, p in frozen if not torch.equal(p.detach(), before[n])]
    optimizer_numel = _optimizer_numel(engine.optimizer)
    offloader = getattr(engine.module, "ac_offloader", None)
    offloaded = (offloader.offloaded, offloader.prefetch_misses) if offloader is not None else None
    with timed(f"{tag}: destroy"):
        engine.destroy()
        settle_garbage()
    return {"variant": variant, "policy": policy, "backend": backend, "plan_backend": plan.backend,
            "leaf_layers": checked.zero3.leaf_layers, "steps": probe.steps, "grads": grads, "losses": losses,
            "compiles": compiles.compiles, "late_compiles": compiles.late, "compile_line": checked.compile.line,
            "compiled_calls": compiled, "activation_bytes": activation_bytes, "plan_layers": list(plan.layers),
            "frozen": sorted(before), "frozen_changed": changed, "optimizer_numel": optimizer_numel,
            "trainable_line": next((line for line in checked.model_lines if line.startswith("trainable")), ""), "reference": reference,
            "plan_offload": list(plan.offload), "offloaded": offloaded}


@contextlib.contextmanager
def as_on_a_gpu():
    """The run's RecomputeSpec resolved as for a CUDA device: the JSON's cpu_checkpointing takes effect (memtrain's
    offload; on a CPU it is a no-op), the rest of the run stays on the CPU. The offloader's copies are then plain
    host copies; CUDA's stream ordering of them is what tests/unit/recompute/test_offload.py checks with DeferredCopies."""
    import dataclasses

    from memtrain.config import recompute_spec

    resolve = recompute_spec.resolve_recompute

    def on_cuda(ds_config, section, device, *args, **kwargs):
        return dataclasses.replace(resolve(ds_config, section, "cuda", *args, **kwargs), device=device)

    recompute_spec.resolve_recompute = on_cuda
    try:
        yield
    finally:
        recompute_spec.resolve_recompute = resolve


def _plain_peft_grads(module, recipe, config, world, rank):
    """The engine's starting weights (gathered, a collective) in a plain model with the same adapters, no
    DeepSpeed: the adapters' gradients of the mean loss over every rank's first batch (run_case draws them).
    On rank 0; None elsewhere."""
    import deepspeed

    from memtrain.model.build import build_model
    from memtrain.model.lora import add_lora, is_adapter

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        state = {n: p.detach().clone() for n, p in module.state_dict().items()}
    if rank != 0:
        return None
    plain = build_model(recipe.model, config)
    add_lora(plain, recipe.model.lora)
    plain.load_state_dict(state)
    for r in range(world):
        torch.manual_seed(100 + r)
        ids = torch.randint(0, config.vocab_size, (2, 32))
        (plain(input_ids=ids, labels=ids).loss / world).backward()
    return {n: p.grad.detach().clone() for n, p in plain.named_parameters() if is_adapter(n)}


def _optimizer_numel(optimizer) -> int:
    """Elements of the parameters DeepSpeed's optimizer holds states for (ZeRO-3, ZeRO-1/2, or a bare torch one)."""
    groups = getattr(optimizer, "fp16_groups", None) or getattr(optimizer, "bit16_groups", None)
    if groups is None:
        inner = getattr(optimizer, "optimizer", optimizer)
        groups = [g["params"] for g in inner.param_groups]
    return sum(getattr(p, "ds_numel", p.numel()) for group in groups for p in group)


# every family of the matrix (tests/families.py): built under zero.Init by the trainer's build_engine, then
# initialised; Gemma's, Phi-3's and OLMo-2's init indexes a weight (the embedding's padding_idx row)
from families import FAMILIES, SP_MHA, overrides  # noqa: E402  (tests/ is this script's directory)

# each family trains 3 steps under ZeRO-3 with one policy; together they take every policy, the layers' own
# arguments in sqrt segments (Gemma-2, Gemma-3) and the MoE experts in fp32
FAMILY_POLICIES = {"llama": "full", "qwen2": "op", "qwen3": "selective:attn", "mistral": "every:2", "gemma": "sqrt",
                   "gemma2": "sqrt", "gemma3_text": "sqrt", "phi3": "selective:mlp", "olmo2": "full", "gpt2": "op",
                   "gpt_neox": "full", "opt": "selective:attn", "falcon": "sqrt", "starcoder2": "selective:mlp",
                   "granite": "op", "mixtral": "full", "qwen2_moe": "sqrt", "qwen3_moe": "selective:mlp"}


def family_args(family, out_dir, rank):
    """src/train.py's arguments for the family's tiny model with its policy."""
    from memtrain.config.args import parse_args

    sets = [*overrides(family), "data.seq_len=32", "train.micro_batch_size=2", "data.random_tokens=true",
            f"data.cache_dir={out_dir / 'cache'}", f"activation_checkpointing.policy={FAMILY_POLICIES[family]}"]
    return parse_args(["--deepspeed", json_for("leaf", out_dir, rank), *sum((["--set", o] for o in sets), [])])


def family_steps(family, out_dir, rank, world) -> dict:
    """The family's tiny model with its policy, set up as src/train.py does: its ZeRO-3 build's initial weights
    against a plain build's (init_stats), then 3 training steps: the losses (all-reduced by the engine's loss, the
    same on every rank), the plan's policy and its model lines."""
    from memtrain.config.ds_config import model_hidden_size, resolve_ds_config
    from memtrain.model.build import build_model
    from memtrain.train.preflight import resolve_run
    from memtrain.train.trainer import build_engine

    args = family_args(family, out_dir, rank)
    with timed(f"family {family}: resolve"):
        checked = resolve_run(args, world)  # one rank measures its profiles, the other waits and reads them
    ds_config = checked.zero3.apply(resolve_ds_config(args.ds_config, args.recipe, world, out_dir / "run",
                                                      checked.plan.checkpoint_calls,
                                                      hidden_size=model_hidden_size(checked.config)))
    with timed(f"family {family}: build_engine"):
        engine, _, _, _ = build_engine(args.recipe, checked.config, checked.plan, ds_config, args.ds_config, checked.spec)
    torch.manual_seed(0)
    with timed(f"family {family}: init stats"):
        stats = init_stats(engine.module, build_model(args.recipe.model, checked.config))
    torch.manual_seed(7 + rank)
    losses = []
    for _ in timed_range(f"family {family}: steps", 3):
        ids = torch.randint(0, checked.config.vocab_size, (2, 32))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    settle_garbage()
    return {"policy": checked.plan.policy, "losses": losses, "model_lines": list(checked.model_lines),
            "leaf_layers": checked.zero3.leaf_layers, "init": stats}


def init_stats(zero3, plain) -> dict:
    """Per parameter [std, mean, the padding row's max |x|] of the engine's model, built under zero.Init and
    initialised (gathered: a collective), the same of `plain`, a build without DeepSpeed (another draw), and the
    parameter's element count."""
    import deepspeed

    stats = {}
    embedding = zero3.get_input_embeddings()  # its padding_idx row, where it has one, is zero
    pad = embedding.padding_idx
    for (name, p), (plain_name, q) in zip(zero3.named_parameters(), plain.named_parameters(), strict=True):
        assert name == plain_name, (name, plain_name)
        with deepspeed.zero.GatheredParameters([p]):
            full = p.detach().clone()
        row = lambda t: float(t[pad].abs().max()) if pad is not None and p is embedding.weight else None  # noqa: E731,B023
        stats[name] = [[float(full.float().std()) if full.numel() > 1 else 0.0, float(full.float().mean()), row(full)],
                       [float(q.float().std()) if q.numel() > 1 else 0.0, float(q.float().mean()), row(q.detach())],
                       full.numel()]
    return stats


def main() -> None:
    import deepspeed
    import deepspeed.comm as dist

    from memtrain.train.trainer import _skip_shm_comm_op

    TIMES["startup to main (imports)"] = [0.0, time.process_time(), 1]
    start = time.perf_counter()
    out_dir = Path([a for a in sys.argv[1:] if not a.startswith("--")][0])
    _skip_shm_comm_op()
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    settle_garbage()  # the imports'
    with timed("all cases"):
        results = [run_case(*case, out_dir, rank, world) for case in CASES]
    # the gradients as tensors (torch.save: JSON lists of them took a minute and most of a GB)
    tensors = [{key: result.pop(key) for key in ("grads", "reference")} for result in results]
    if rank == 0:
        torch.save(tensors, out_dir / "grads0.pt")
    with timed("write rank json"):
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    with timed("all families"):
        (out_dir / f"families{rank}.json").write_text(json.dumps({f: family_steps(f, out_dir, rank, world)
                                                                  for f in FAMILIES}))
    # last: Ulysses replaces sdpa for the rest of the process. The multi-head families' head layout, beside
    # tests/long_context_worker.py's (one layout per process)
    from long_context_worker import sp_family_cases

    with timed("all sp"):
        sp = sp_family_cases(SP_MHA)
        (out_dir / f"sp{rank}.json").write_text(json.dumps(sp()))
    dist.barrier()
    if os.environ.get("MEMTRAIN_TEST_TIMING"):
        TIMES["process total"] = [time.perf_counter() - start, time.process_time(), 1]
        dump_times()


if __name__ == "__main__":
    main()

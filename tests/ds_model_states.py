"""Launcher script for test_planner.test_model_states_match_deepspeed_per_term: real ZeRO engines, each
model-state term measured from the engine's own tensors, beside memtrain's model_states.

Run by `deepspeed --num_gpus 2 tests/ds_model_states.py OUT_DIR CASE...` (CPU gloo ranks); CASE is
"<stage>" (0 to 3), "<stage>+opt" (offload_optimizer to the CPU), "3+opt+param" (and offload_param) or
"<stage>+nooverlap" (overlap_comm off; the JSON has it on) or "<stage>+frozen" (the recipe's train.frozen
takes the embedding and every attention block out of training, as the trainer does: memtrain.model.freeze);
"+mb2" makes the micro-batch 2 rows, "+ga2" accumulates gradients over 2 micro-steps; "+tp2" runs DeepSpeed's
AutoTP over the 2 ranks (one data-parallel rank), "+sp2" Ulysses over them (memtrain.train.long_context, as the
trainer registers it; micro-batch 1 and after every other case: the registration holds for the whole process).
A TP or SP group reads one batch, so those cases feed both ranks the same ids. Collectives on a group of one rank
move nothing and are not counted.
Each rank writes OUT_DIR/rank<r>.json: per case, the measured bytes of every term and the
prediction. Terms are counted by tensor storage (views and aliases once), from the structures
that hold them (DeepSpeed 0.19.8's attribute names), not from memtrain:
  params      this rank's parameters: stage 1/2 the flat bit16 buffer; stage 3 its ds_tensor partitions
  persistent  stage 3: the whole parameters kept on every rank (ds_persist), apart from their partitions
  gathered    stage 3: non-persistent parameters still whole after the backward (DeepSpeed released them);
              gathered_in_forward: the most of them whole at once in the forward (sampled at every
              module's forward, after DeepSpeed's fetch)
  grads       gradients on the device: stage 1/2 the parameters' .grad, the averaged and contiguous
              gradient partitions; stage 3 the flat gradient-partition buffer
  master      the fp32 master partitions the optimizer updates
  adam        the optimizer's per-parameter state tensors (exp_avg, exp_avg_sq)
  buckets     stage 3: the contiguous ipg reduce bucket
  reduce_buckets / reduce_scratch  stage 1/2: the ipg buckets read just before the backward frees
              them, and the largest copy its reduction flattens
  host        what lives in the offload path: with offload_optimizer the optimizer's fp32 partitions,
              their .grad and states, and ZeRO-3's gradient partitions (on its offload device) or
              ZeRO-1/2's bit16 copy-back buffer and host gradient staging buffer; with offload_param
              the parameter partitions
  other       every other CPU tensor storage created since before the engine (should be ~0)
  peak        the second step's peak of CPU tensor bytes, the highest of its micro-steps': the bytes alive before
              one (every CPU storage created since before the engine) plus the highest rise of the CPU allocator's own
              allocations and frees in it (torch.profiler's memory events: c10's CPU allocator reports each),
              the CPU's stand-in for CUDA's max_memory_allocated; beside memtrain.memory.predict's peak
Measured after the second backward (before its step): optimizer states exist, gradients are
complete, no activation is alive. On CPU "host" and "device" are one memory: which side a term
is on is read from DeepSpeed's layout (the offloaded optimizer's tensors), the bytes are real.
"""
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch


def storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, (list, tuple)):
            out.update(storages(t))
        elif isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def all_cpu_storages(model=None) -> dict[int, int]:
    """Every CPU tensor storage Python reaches, and `model`'s gradients: a .grad autograd made has no Python object
    (gc does not see it) until it is read; an accumulated one outlives a micro-step."""
    gc.collect()
    grads = [p.grad for p in model.parameters()] if model is not None else []
    return storages([o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
                    + [g for g in grads if g is not None and g.device.type == "cpu"])


COLLECTIVES = {"on": False, "gather": 0, "reduce": 0, "all_to_all": 0, "other": 0}  # tensor bytes on torch.distributed's collectives


def count_collectives() -> None:
    """Count the tensor bytes of every collective DeepSpeed calls (an all-gather's output, a reduction's input)
    while COLLECTIVES["on"]; one- or two-element calls (flags, norms) are left out."""
    import torch.distributed as tdist

    kinds = {"all_gather_into_tensor": "gather", "_all_gather_base": "gather", "all_gather": "gather",
             "all_reduce": "reduce", "reduce": "reduce", "reduce_scatter_tensor": "reduce",
             "_reduce_scatter_base": "reduce", "reduce_scatter": "reduce", "broadcast": "other",
             "all_to_all_single": "all_to_all", "all_to_all": "all_to_all"}
    for name, kind in kinds.items():
        fn = getattr(tdist, name, None)
        if fn is None:
            continue

        def counted(*args, fn=fn, name=name, kind=kind, **kwargs):
            group = kwargs.get("group", next((a for a in args if isinstance(a, tdist.ProcessGroup)), None))
            if COLLECTIVES["on"] and tdist.get_world_size(group) > 1:  # a group of one moves nothing
                given = [*args, *kwargs.values()]
                tensors = [a for a in given if isinstance(a, torch.Tensor)]
                lists = [a for a in given if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
                if lists:  # all_gather, reduce_scatter: the list's tensors
                    t, tensor_bytes = lists[0][0], sum(x.numel() * x.element_size() for x in lists[0])
                else:  # an all-gather's output and a reduce-scatter's input are the larger of the two
                    t = max(tensors, key=torch.Tensor.numel)
                    tensor_bytes = t.numel() * t.element_size()
                if tensor_bytes > 2 * t.element_size():
                    COLLECTIVES[kind] += tensor_bytes
            return fn(*args, **kwargs)

        setattr(tdist, name, counted)


def held_cpu_storages() -> dict:
    """Every CPU tensor storage alive now, held by reference: none is freed while the case runs, so no new tensor
    reuses its address and is taken for it (a storage left by an earlier case, freed later, did: up to 7 MB)."""
    gc.collect()
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in gc.get_objects()
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()}


def parse_case(case: str) -> dict:
    """A CASE's stage and options (see the module doc)."""
    stage, *options = case.split("+")
    return {"stage": int(stage), "options": set(options), "micro": 2 if "mb2" in options else 1,
            "accum": 2 if "ga2" in options else 1, "tp": 2 if "tp2" in options else 1,
            "sp": 2 if "sp2" in options else 1}


def case_recipe(c: dict):
    from memtrain.config.recipe import load_recipe

    # memtrain's own Ulysses loss is the standard one here, as the profile predicts it
    return load_recipe(None, ["data.seq_len=32", f"train.micro_batch_size={c['micro']}",
                              f"train.grad_accum_steps={c['accum']}", f"parallel.sequence={c['sp']}",
                              "train.loss=standard"])


def case_ds_config(c: dict, recipe, world: int, root: Path) -> dict:
    """The JSON of a case: zero3_noac.json, fp32, small buckets, the case's ZeRO stage, offload and AutoTP."""
    from memtrain.config.ds_config import load_ds_config, resolve_ds_config
    from memtrain.memory.target import resolve_spec

    stage, options = c["stage"], c["options"]
    raw = load_ds_config(str(root / "ds_configs" / "zero3_noac.json"))
    raw.pop("tensorboard", None)
    zero = raw["zero_optimization"]
    # small buckets, so that no term is swamped by one (the model is ~0.9 M parameters)
    zero.update(stage=stage, reduce_bucket_size=100000, stage3_prefetch_bucket_size=100000,
                stage3_param_persistence_threshold=1000)
    if stage == 0:  # torch's AdamW (DeepSpeed's fused Adam would JIT-build an op)
        raw["optimizer"]["params"]["torch_adam"] = True
    if "opt" in options:
        zero["offload_optimizer"] = {"device": "cpu"}
        # torch's AdamW on the host partitions (DeepSpeed's CPU Adam would JIT-build an op):
        # the same two fp32 moments per element
        raw["optimizer"]["params"]["torch_adam"] = True
        raw["zero_force_ds_cpu_optimizer"] = False
    if "nooverlap" in options:
        zero["overlap_comm"] = False
    if "param" in options:
        zero["offload_param"] = {"device": "cpu"}
    if c["tp"] > 1:
        raw["tensor_parallel"] = {"autotp_size": c["tp"]}
    cfg = resolve_ds_config(raw, recipe, world, Path("unused"), 0)
    if c["tp"] > 1:  # ZeRO-3 on one data-parallel rank: the residency and leaf layers the trainer's preflight sets
        cfg = resolve_spec(recipe, cfg, world, "cpu")[1].apply(cfg)
    return cfg


def build_engine(c: dict, cfg: dict, recipe, config, frozen_recipe):
    """The case's DeepSpeed engine (ZeRO-3 built under zero.Init, as the trainer does; Ulysses registered through
    memtrain.train.long_context before deepspeed.initialize) and what its micro-steps feed it."""
    import deepspeed

    from memtrain.model.build import build_model
    from memtrain.model.freeze import freeze
    from memtrain.train import long_context

    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=c["stage"] == 3):
        model = build_model(recipe.model, config)
    if "frozen" in c["options"]:
        freeze(model, frozen_recipe.train.trainable, frozen_recipe.train.frozen)
    ctx = long_context.prepare(model, recipe, c["stage"], c["tp"]) if c["sp"] > 1 else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg, mpu=ctx.mpu if ctx else None)
    # a TP or SP group reads one batch (the same ids on both ranks); data-parallel ranks read their own
    grouped = c["tp"] > 1 or c["sp"] > 1
    ids = torch.randint(0, config.vocab_size, (c["micro"], 32),
                        generator=torch.Generator().manual_seed(7) if grouped else None)
    feed = ctx.sp.slice_batch(ids) if ctx else {"input_ids": ids, "labels": ids}
    return engine, model, feed


def main() -> None:
    import deepspeed
    import deepspeed.comm as dist

    from memtrain.config.recipe import load_recipe
    from memtrain.memory.target import model_and_config
    from memtrain.train.trainer import _skip_shm_comm_op

    args = [a for a in sys.argv[1:] if not a.startswith("--")]  # the launcher adds --local_rank
    out_dir, cases = Path(args[0]), args[1:]
    _skip_shm_comm_op()
    count_collectives()  # before DeepSpeed's backend keeps its own references to the functions
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    frozen_recipe = load_recipe(None, ["data.seq_len=32", "train.frozen=[model.embed_tokens.*,*.self_attn.*]"])
    config = model_and_config(load_recipe(None, ["data.seq_len=32"]))
    torch.manual_seed(rank)
    root = Path(__file__).resolve().parents[1]
    # The imports' objects out of the collector's sight: each case's storage scans (gc.collect, gc.get_objects) and
    # DeepSpeed's gc.collect in each engine's set-up then walk only what came after (4 full collections a case, 1.2
    # CPU-s of them a rank). The imports make no storage a case measures: every one made later is still seen.
    gc.freeze()
    results = {}
    for case in cases:
        results[case] = run_case(parse_case(case), config, frozen_recipe, world, root)
        gc.collect()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def watch_reductions(opt, seen: dict) -> None:
    """ZeRO-1/2: record the backward's ipg buckets just before DeepSpeed frees them, and the largest copy its
    reduction flattens (a view allocates nothing)."""
    release, flatten = opt._release_ipg_buffers, opt.flatten

    def _release():
        seen["reduce_buckets"] = max(seen["reduce_buckets"], sum(storages(
            b for bucket in opt.ipg_buckets.values() for b in bucket.buffer).values()))
        release()

    def _flatten(tensors):
        t = flatten(tensors)
        ptr = t.untyped_storage().data_ptr()
        if seen["backward"] and all(ptr != x.untyped_storage().data_ptr() for x in tensors):
            seen["reduce_scratch"] = max(seen["reduce_scratch"], t.untyped_storage().nbytes())
        return t

    opt._release_ipg_buffers, opt.flatten = _release, _flatten


def run_steps(engine, model, feed: dict, accum: int, base: dict, seen: dict) -> dict:
    """Two optimizer steps of `accum` micro-steps: the second step's peak of CPU tensor bytes (the highest of its
    micro-steps') into `seen`; returns one optimizer step's collective bytes, counted after the first step's
    micro-steps: the first step's update, then the second step's forwards and backwards. With accumulation 1 the
    window holds ZeRO-3's one check of its trace (the second forward; with accumulation 2 it came before)."""
    from conftest import profiled_peak_rise  # tests/ is this script's directory

    for step, micro_step in [(s, m) for s in range(2) for m in range(accum)]:
        last = micro_step == accum - 1
        if step == 1:
            alive = sum(v for k, v in all_cpu_storages(model).items() if k not in base)
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            prof.start()
        loss = engine(**feed).loss
        seen["backward"] = True
        engine.backward(loss)
        seen["backward"] = False
        del loss
        if step == 1:
            prof.stop()
            rise = profiled_peak_rise(prof, earlier_frees=True)  # `alive` holds the blocks made before the window
            seen["peak"] = max(seen.get("peak", 0), alive + rise)
            seen.setdefault("micro_peaks", []).append([alive, alive + rise])
            del prof
        if step == 1 and last:
            break
        if step == 0 and last:
            COLLECTIVES.update(on=True, gather=0, reduce=0, all_to_all=0, other=0)
        engine.step()  # an optimizer step at the accumulation boundary only
    COLLECTIVES["on"] = False
    return {k: COLLECTIVES[k] for k in ("gather", "reduce", "all_to_all", "other")}


def run_case(c: dict, config, frozen_recipe, world: int, root: Path) -> dict:
    """One case: its engine, two steps, every term measured beside the prediction."""
    stage = c["stage"]
    recipe = case_recipe(c)
    cfg = case_ds_config(c, recipe, world, root)
    base = held_cpu_storages()
    engine, model, feed = build_engine(c, cfg, recipe, config, frozen_recipe)
    opt = engine.optimizer
    seen = {"reduce_buckets": 0, "reduce_scratch": 0, "backward": False}
    if stage in (1, 2):
        watch_reductions(opt, seen)
    hooks = []
    if stage == 3:  # the largest gathered set in the forward: whole non-persistent parameters alive
        gatherable = [p for p in model.parameters() if not getattr(p, "ds_persist", False)]

        def sample(module, *args):
            seen["gathered"] = max(seen["gathered"], sum(storages(p.data for p in gatherable).values()))

        seen["gathered"] = 0
        hooks = [m.register_forward_pre_hook(sample) for m in model.modules()]  # after DeepSpeed's fetch
    counted_step = run_steps(engine, model, feed, c["accum"], base, seen)
    if stage == 3:  # the trace ZeRO-3 checks once, at the forward after it was recorded (broadcast from rank 0)
        counted_step["trace_check"] = trace_check_bytes(opt)
    for h in hooks:
        h.remove()
    terms = measured_terms(c, model, opt)
    counted = {}
    for term in terms.values():
        counted.update(term)
    now = all_cpu_storages()
    other = sum(v for k, v in now.items() if k not in base and k not in counted)
    measured = {name: sum(t.values()) for name, t in terms.items()}
    measured.update(other=other, gathered_in_forward=seen.get("gathered", 0),
                    reduce_buckets=seen["reduce_buckets"], reduce_scratch=seen["reduce_scratch"], peak=seen["peak"],
                    micro_peaks=seen["micro_peaks"])
    predicted, collectives = prediction(c, config, cfg, recipe, frozen_recipe, world)
    del engine, model, opt, terms, counted
    return {"measured": measured, "predicted": predicted,
            "collectives": {"measured": counted_step, "predicted": collectives}}


def trace_check_bytes(opt) -> int:
    """ZeRO-3's one check of its recorded trace (DeepSpeed 0.19.8 PartitionedParameterCoordinator.reset_step, at the
    forward after the one that recorded it: assert_ints_same_as_other_ranks -> get_lst_from_rank0): an int64
    broadcast of the submodules' ids, of the parameters' ids and of their last-use step ids, in trace order."""
    coordinator = opt.parameter_offload.get_param_coordinator()
    name = type(coordinator).__name__
    submodules, params = (getattr(coordinator, f"_{name}__{k}") for k in ("submodule_order", "param_order"))
    return 8 * (len(submodules) + 2 * len(params))


def measured_terms(c: dict, model, opt) -> dict:
    """Every model-state term, read from the engine's own tensors (see the module doc)."""
    stage, options = c["stage"], c["options"]
    params = list(model.parameters())
    inner = getattr(opt, "optimizer", opt)  # the torch optimizer DeepSpeed drives (ZeRO-0: the optimizer)
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    adam = storages(v for state in inner.state.values() for k, v in state.items() if k != "step")
    if stage == 3:
        param_parts = storages(p.ds_tensor for p in params)
        whole = storages(p.data for p in params if getattr(p, "ds_persist", False))
        persistent = {k: v for k, v in whole.items() if k not in param_parts}
        gathered = storages(p.data for p in params if not getattr(p, "ds_persist", False))
        grads = storages([opt.grad_partitions_flat_buffer])
        master = storages(opt.fp32_partitioned_groups_flat)
        buckets = storages(b.buffer for b in opt.ipg_buckets.values())
    elif stage == 0:  # whole parameters, their .grad; fp32 training keeps no master copy
        param_parts = storages(p.data for p in params)
        persistent, gathered, buckets, master = {}, {}, {}, {}
        grads = storages([p.grad for p in params])
    else:
        param_parts = storages(p.data for p in params)
        persistent, gathered, buckets = {}, {}, {}  # stage 1/2 gather nothing
        grads = storages([p.grad for p in params] + list(opt.averaged_gradients.values())
                         + [getattr(opt, "grads_in_partition", None)])
        master = storages(opt.single_partition_of_fp32_groups)
    master_grads = {} if stage == 0 else storages([p.grad for p in opt_params] + [t.grad for t in (
        opt.fp32_partitioned_groups_flat if stage == 3 else opt.single_partition_of_fp32_groups)])
    host = {}
    if "opt" in options:  # the offloaded optimizer's tensors: fp32 partitions, their gradients, states
        host.update(master)
        host.update(master_grads)
        host.update(adam)
        if stage == 3:  # DeepSpeed's gradient partitions live on its offload device (opt.device)
            host.update(grads)
        else:  # the bit16 buffer the update is copied back through, the host side of the gradient staging
            host.update(storages(opt.param_buffer_of_bit16_for_cpu_offload_groups))
            host.update(storages([opt.temp_grad_buffer_for_cpu_offload]))
            host.update(storages(opt.accumulated_grads_in_cpu.values()))  # ZeRO-2's accumulation buffers
            grads.update(storages([opt.temp_grad_buffer_for_gpu_offload]))  # the device side
        master, adam = {}, {}
        grads = {k: v for k, v in grads.items() if k not in host}
    else:
        grads.update(master_grads)  # an fp32 gradient partition made for the update (none expected)
    if "param" in options:
        host.update(param_parts)
        param_parts = {}
    return {"params": param_parts, "persistent": persistent, "gathered": gathered, "grads": grads,
            "master": master, "adam": adam, "buckets": buckets, "host": host}


def prediction(c: dict, config, cfg: dict, recipe, frozen_recipe, world: int) -> tuple[dict, dict]:
    """memtrain's model states and peak for the case, and its collectives (as make plan builds its target)."""
    from memtrain.memory.predict import predict
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.states import model_states
    from memtrain.memory.target import make_target

    target = make_target(recipe, cfg, world, "cpu")
    if "frozen" in c["options"]:  # what train.frozen leaves to train, as make plan counts it (on the meta model)
        made = make_target(frozen_recipe, cfg, world, "cpu")
        target = replace(target, trainable_params=made.trainable_params, all_params=made.all_params)
    profile = profile_activations(config, target, ("keep",))
    states = model_states(profile, cfg, target)
    predicted = predict(profile, states, ("keep",) * config.num_hidden_layers)
    out = {k: getattr(states, k) for k in ("params", "grads", "optimizer", "buckets", "persistent", "gathered",
                                           "update", "host", "reduce_buckets", "reduce_scratch", "accumulated",
                                           "accumulating")} | peak_terms(predicted)
    out["prefetch_buffer"] = held_prefetch_buffer(profile, cfg, target)
    out["target"] = {"tp": target.tp, "sp": target.sequence_parallel, "seq_len": target.seq_len,
                     "loss": target.loss, "dtype": target.dtype}
    return out, predicted_collectives(config, cfg, target, profile)


def held_prefetch_buffer(profile, cfg: dict, target) -> int:
    """The part of memtrain's ZeRO-3 `gathered` that is no parameter: the prefetch all-gather's flat buffer, counted
    where every parameter stays gathered (memtrain.memory.states.prefetch_buffer); 0 elsewhere."""
    from memtrain.config.zero3 import resident
    from memtrain.memory.states import keeps_gathered, persistent_elements, prefetch_buffer, zero_config

    zero, world = zero_config(cfg), max(target.world_size // target.tp, 1)
    if int(zero.stage) != 3 or resident(cfg, world) or not keeps_gathered(zero, profile.num_params, world):
        return 0
    gatherable = profile.num_params - persistent_elements(profile, zero)
    return prefetch_buffer(profile, zero, target.torch_dtype.itemsize, gatherable)


def peak_terms(prediction) -> dict:
    """memtrain.memory.predict's forward/backward peak by term; on CPU the host's part is the same memory."""
    return {"peak": prediction.peak, "activation_peak": prediction.activation_peak,
            "reduce_buffers_at_peak": prediction.reduce_buffers, "released_at_peak": prediction.released,
            "host_activations": prediction.host_activations,
            "states_total": prediction.model_states.total, "peak_phase": prediction.phase}


def predicted_collectives(config, cfg: dict, target, profile) -> dict:
    """Tensor bytes of one optimizer step of `target.grad_accum` micro-steps by memtrain.memory.comm_volume
    (step_collectives, as the search scores a configuration), from the memory model's parameter counts
    (memtrain.memory.score.model_shape)."""
    from memtrain.config.zero3 import resident
    from memtrain.memory.comm_volume import MICRO, Layout, step_collectives
    from memtrain.memory.score import model_shape
    from memtrain.memory.states import keeps_gathered, persistent_elements, zero_config

    zero = zero_config(cfg)
    stage = int(zero.stage)
    layout = Layout(target.world_size, target.world_size, target.tp, target.sequence_parallel)
    persistent = persistent_elements(profile, zero) if stage == 3 else 0
    shape = model_shape(config, profile, target, persistent)
    gathers = 1 if keeps_gathered(zero, profile.num_params, layout.zero) else 2
    kinds = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "reduce", "all_to_all": "all_to_all"}
    out = {"gather": 0, "reduce": 0, "all_to_all": 0}
    elem = target.torch_dtype.itemsize
    modes = ("keep",) * profile.num_layers
    for c in step_collectives(shape, stage, elem, layout, target.micro_batch_size * target.seq_len, modes, gathers,
                              resident(cfg, layout.zero)):
        out[kinds[c.kind]] += int(c.bytes) * (target.grad_accum if c.phase == MICRO else 1)
    return out


if __name__ == "__main__":
    main()

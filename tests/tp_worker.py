"""Run by tests/launch/test_tensor_parallel.py under make train's launcher (2 gloo ranks): several
tensor-parallel checks in one launch (each launch costs ~30 s before its first step). Rank 0 writes
the measured numbers to the JSON file named by argv[1]; the test asserts on them.

Checks, in order (the trainer last: it closes the process group):
  configure_guard  partition.tp_mpu before deepspeed.initialize refuses (the groups do not exist yet)
  zero_init        a ZeRO-3 model built under zero.Init gets transformers' init (std, first loss vs a plain build)
  parity_z1/z3     AutoTP=2 against a single-process TP=1 reference, 5 AdamW steps, same batches, clipped alike
  partition        checkpointed-input bytes per rank (autograd graph walk, analytic) and gradients, partition on/off
  hidden_states    output_hidden_states with partitioning on keeps full-shape layer inputs
  families         every family of tests/families.py that AutoTP takes: AutoTP=2 under ZeRO-3 against a plain TP=1
                   copy of the same weights, 2 AdamW steps in lock-step (the second loss follows the first's gradients)
  trainer          src/train.py's train() with TP=2 + partition: tokens counted once (one measured interval), the plan line
"""
from __future__ import annotations

import copy
import gc
import json
import os
import sys

import torch

from conftest import EVAL_PATHS, autograd_nodes

from memtrain.config.recompute_spec import resolve_recompute
from memtrain.config.recipe import ACSection, ModelSection
from memtrain.recompute.meter import ActivationMeter
from memtrain.model.build import build_config, build_model
from memtrain.model.data import RandomTokens
from memtrain.model.zero_init import build_model_zero3
from memtrain.recompute import partition
from memtrain.recompute.hooks import apply_plan, configure_deepspeed_ac, remove_plan
from memtrain.recompute.policy import build_plan
from memtrain.train import parallel
from memtrain.train.trainer import _skip_shm_comm_op

OUT = ""  # set by main(): the results file
SEQ, MBS, VOCAB, LAYERS, HIDDEN = 32, 2, 257, 2, 64
SECTION = ModelSection(type="llama", config={"hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": LAYERS,
                                             "num_attention_heads": 4, "num_key_value_heads": 2,
                                             "max_position_embeddings": 64})
CONFIG = build_config(SECTION, VOCAB, SEQ)
results: dict = {}


def spec_for(cfg: dict, reentrant: bool = True):
    """The RecomputeSpec of policy full on DeepSpeed's checkpoint under `cfg`, TP 2, as a GPU run decides it."""
    return resolve_recompute(cfg, ACSection(policy="full", backend="deepspeed", deepspeed_reentrant=reentrant), "cuda", 2)


def ds_config(stage: int, tp: int, ac: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 10**9}
    if ac is not None:
        cfg["activation_checkpointing"] = {"number_checkpoints": LAYERS, **ac}
    return cfg


def gathered_state(model, stage: int) -> dict:
    import deepspeed

    if stage != 3:
        return copy.deepcopy(model.state_dict())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_configure_guard() -> None:
    plan = build_plan(spec_for({"activation_checkpointing": {"partition_activations": True}}), LAYERS)
    try:
        partition.tp_mpu(plan, 2)
        results["configure_guard"] = "no error"
    except RuntimeError as e:
        results["configure_guard"] = str(e)


def check_zero_init() -> None:
    import deepspeed

    ids = RandomTokens(VOCAB, SEQ, 7).batch(0, 0, 0, 1, 16, 1)  # 512 tokens: a steady first loss
    torch.manual_seed(0)
    plain = build_model(SECTION, CONFIG)
    torch.manual_seed(0)
    fixed = build_model_zero3(SECTION, CONFIG, ds_config(3, 1))
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(3, 1)):  # what memtrain did before: torch's init
        bare = build_model(SECTION, CONFIG)
    with torch.no_grad():
        row = {"plain_loss": plain(input_ids=ids, labels=ids).loss.item(), "std": {}}
        for name, model in (("fixed", fixed), ("bare", bare)):
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                row[f"{name}_loss"] = model(input_ids=ids, labels=ids).loss.item()
                for (n, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
                    row["std"].setdefault(n, {"plain": p.std().item()})[name] = q.std().item()
    results["zero_init"] = row


def _lock_step(section: ModelSection, config, stage: int, ac: dict, steps: int):
    """An AutoTP=2 engine (DP=1 on 2 ranks) and a plain torch TP=1 copy of its weights, trained in lock-step on
    the same global batches with the same dropout masks (seeded per step). Returns the engine, the copy, the
    layout and both runs' losses."""
    import deepspeed

    torch.manual_seed(0)
    cfg = ds_config(stage, 2, ac)
    model = build_model_zero3(section, config, cfg) if stage == 3 else build_model(section, config)
    ref = build_model(section, config)
    ref.load_state_dict(gathered_state(model, stage))
    spec = spec_for(cfg)
    plan = build_plan(spec, config.num_hidden_layers)
    apply_plan(model, plan)
    model.train()
    ref.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    layout = parallel.layout(engine)
    parallel.check_sharded(engine.module, layout.tp)
    configure_deepspeed_ac(spec, config.num_hidden_layers, partition.tp_mpu(plan, layout.tp))
    partition.check_configured(plan, layout.tp)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = RandomTokens(VOCAB, SEQ, 11)
    losses, ref_losses = [], []
    for step in range(steps):
        ids = data.batch(step, 0, layout.dp_rank, layout.dp_size, MBS, 1)
        torch.manual_seed(step)  # the same dropout masks (GPT-NeoX, OPT, Falcon have dropout keys)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        torch.manual_seed(step)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed clips at gradient_clipping 1.0
        opt.step()
        opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return engine, ref, layout, losses, ref_losses


def _tp_layers(engine) -> int:
    from deepspeed.module_inject.layers import TensorParallel_Layer

    return sum(isinstance(m, TensorParallel_Layer) for m in engine.module.modules())


def check_parity(stage: int) -> None:
    """AutoTP=2 against plain torch TP=1 over 5 lock-step steps, and the final/ it writes."""
    engine, ref, layout, losses, ref_losses = _lock_step(
        SECTION, CONFIG, stage, {"partition_activations": True, "contiguous_memory_optimization": stage == 3,
                                 "synchronize_checkpoint_boundary": stage == 3}, 5)
    results[f"parity_z{stage}"] = {"losses": losses, "ref_losses": ref_losses, "tp": layout.tp,
                                   "dp_size": layout.dp_size, "dp_rank": layout.dp_rank, "tp_layers": _tp_layers(engine)}
    # final/ as the trainer writes it: whole weights (TP shards gathered), equal to the reference's
    from pathlib import Path

    from memtrain.config.recipe import Recipe
    from memtrain.train.final import save_final

    final = Path(os.path.dirname(OUT)) / f"final_z{stage}"
    save_final(engine, engine.module, final, Recipe(model=SECTION), lambda: build_model(SECTION, CONFIG))
    if int(os.environ["RANK"]) == 0:
        from safetensors.torch import load_file

        saved, want = load_file(str(final / "model.safetensors")), ref.state_dict()
        results[f"parity_z{stage}"]["final"] = {
            "shapes_match": all(tuple(saved[k].shape) == tuple(want[k].shape) for k in saved),
            "keys_match": set(saved) == {k for k in want if k in saved} and len(saved) > 0,
            "max_abs_diff": max((saved[k].float() - want[k].float()).abs().max().item() for k in saved)}
    engine.destroy()


def check_families() -> None:
    """Each family AutoTP can shard (the others are one line before workers start: test_tensor_parallel), ZeRO-3,
    full recompute on DeepSpeed's checkpoint with partitioned inputs: losses of 2 lock-step AdamW steps."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from families import AUTOTP_REFUSED, FAMILIES

    out = {}
    for family in FAMILIES:
        if family in AUTOTP_REFUSED:
            continue
        section = ModelSection(type=family, config=FAMILIES[family])
        engine, _, _, losses, ref_losses = _lock_step(section, build_config(section, VOCAB, SEQ), 3,
                                                      {"partition_activations": True}, 2)
        out[family] = {"losses": losses, "ref_losses": ref_losses, "tp_layers": _tp_layers(engine)}
        engine.destroy()
    results["families"] = out


def _graph_checkpoint_bytes(loss) -> int:
    """Bytes DeepSpeed's checkpoints keep for the backward, found by walking the autograd graph: each
    CheckpointFunction node carries `deepspeed_saved_tensors`; a partitioned input keeps `.saved_data`."""
    total = 0
    for node in autograd_nodes(loss):
        for t in getattr(node, "deepspeed_saved_tensors", None) or ():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                kept = t.saved_data if getattr(t, "saved_data", None) is not None else t
                total += kept.numel() * kept.element_size()
    return total


def check_partition() -> None:
    """One TP=2 model (ZeRO-0 engine for the groups and the sharding); forward/backward on the module."""
    import deepspeed

    torch.manual_seed(0)
    cfg = ds_config(0, 2, {"partition_activations": True})
    model = build_model(SECTION, CONFIG)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    module = engine.module
    ids = RandomTokens(VOCAB, SEQ, 13).batch(0, 0, 0, 1, MBS, 1)  # the same batch on both TP ranks
    row = {}

    def run(name: str, partition_on: bool, mpu_after_initialize: bool = True, reentrant: bool = True, **ac) -> None:
        remove_plan(module)
        if name != "none":
            section = {"partition_activations": partition_on, **ac}
            c = ds_config(0, 2, section)
            spec = spec_for(c, reentrant)
            plan = build_plan(spec, LAYERS)
            apply_plan(module, plan)
            row[f"{name}_offload_impl"] = plan.offload_impl if plan.cpu_checkpointing else None
            configure_deepspeed_ac(spec, LAYERS, partition.tp_mpu(plan, 2) if mpu_after_initialize else None)
            if name == "on":
                row["expected_on"] = partition.checkpoint_input_bytes(plan, CONFIG, MBS, SEQ, 4) // 2
        meter = ActivationMeter()
        with meter.measure():
            loss = module(input_ids=ids, labels=ids).loss
        graph = _graph_checkpoint_bytes(loss)
        loss.backward()
        row[name] = {"graph_bytes": graph, "meter_bytes": meter.bytes, "loss": loss.item()}
        grads[name] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad(set_to_none=True)

    grads: dict = {}
    run("none", False)
    # first configure of the process: configure(None, ...), what memtrain did before (DeepSpeed keeps the
    # model-parallel size of any earlier configure, so this must come first)
    run("no_mpu", True, mpu_after_initialize=False)
    run("off", False)
    run("on", True)
    run("contiguous", True, contiguous_memory_optimization=True, synchronize_checkpoint_boundary=True)
    # with cpu_checkpointing too, DeepSpeed's own CPU_CHECKPOINT moves each rank's partition to the host
    run("cpu", True, cpu_checkpointing=True)
    # DeepSpeed's non-reentrant checkpoint: it keeps its inputs in a closure (no graph node to walk)
    run("nonreentrant_off", False, reentrant=False)
    run("nonreentrant", True, reentrant=False)
    row["analytic_off"] = LAYERS * MBS * SEQ * HIDDEN * 4  # one fp32 hidden state per recomputed layer
    row["grad_max_diff"] = {name: max((grads[name][n] - g).abs().max().item() for n, g in grads["none"].items())
                            for name in ("off", "on", "contiguous", "no_mpu", "cpu", "nonreentrant_off",
                                         "nonreentrant")}
    row["grad_count"] = len(grads["none"])
    row["local_params"] = sum(p.numel() for p in module.parameters())  # this rank's shards (ZeRO-0)

    # output_hidden_states with partitioning on (both DeepSpeed checkpoints): the layer inputs stay whole
    remove_plan(module)
    with torch.no_grad():
        plain = module(input_ids=ids, labels=ids, output_hidden_states=True)
    c = ds_config(0, 2, {"partition_activations": True})
    for reentrant in (True, False):
        spec = spec_for(c, reentrant)
        plan = build_plan(spec, LAYERS)
        remove_plan(module)
        apply_plan(module, plan)
        configure_deepspeed_ac(spec, LAYERS, partition.tp_mpu(plan, 2))
        out = module(input_ids=ids, labels=ids, output_hidden_states=True)
        # read before the backward: DeepSpeed's backward gathers the partitions back into the emptied tensors
        shapes = [list(h.shape) for h in out.hidden_states]
        hidden = [h.detach().clone() for h in out.hidden_states]
        out.loss.backward()
        module.zero_grad(set_to_none=True)
        results["hidden_states" + ("" if reentrant else "_nonreentrant")] = {
            "shapes": shapes,
            "max_diff": max(((a - b).abs().max().item() if a.shape == b.shape else float("inf"))
                            for a, b in zip(hidden, plain.hidden_states)),
        }
    remove_plan(module)
    results["partition"] = row
    engine.destroy()


def check_trainer() -> None:
    """The real trainer with the shipped ds_configs/zero3_tp2_ckpt.json, a little of the default corpus and a
    held-out eval (tests/conftest.py's EVAL_PATHS) at its end."""
    from memtrain.config.args import parse_args
    from memtrain.train.trainer import train

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ds_configs", "zero3_tp2_ckpt.json")
    run_dir = os.path.join(os.path.dirname(OUT), "trainer-run")
    timeouts, new_group = [], torch.distributed.new_group

    def recording_new_group(*args, **kwargs):  # the timeout of each group DeepSpeed makes in the run
        group = new_group(*args, **kwargs)
        timeouts.append(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        return group

    torch.distributed.new_group = recording_new_group
    try:
        summary = train(parse_args(["--deepspeed", path, "--run-dir", run_dir, "--max-steps", "2",
                                    "--set", "data.max_bytes=100000", "--set", EVAL_PATHS,
                                    "--set", "train.eval_batches=2", "--set", "data.seq_len=64",
                                    "--set", "train.micro_batch_size=4", "--set", "train.log_every=1",
                                    "--set", "train.metric_warmup_steps=1", "--set", "train.save_interval=0",
                                    "--set", "train.collective_timeout_s=77"]))
    finally:
        torch.distributed.new_group = new_group
    results["trainer"] = {"metrics": summary["metrics"], "status": summary["status"], "run_dir": run_dir,
                          "group_timeouts_s": timeouts}


def main() -> None:
    import deepspeed

    gc.freeze()  # the imports' objects out of the collector's sight: DeepSpeed's gc.collect in each engine's set-up scans the rest
    global OUT
    OUT = next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))  # the launcher adds --local_rank

    torch.set_num_threads(1)
    _skip_shm_comm_op()
    check_configure_guard()
    deepspeed.init_distributed(verbose=False)
    check_partition()  # first: it needs the first configure of the process
    check_zero_init()
    check_parity(1)
    check_parity(3)
    check_families()
    rank = int(os.environ["RANK"])
    if rank == 0:
        json.dump(results, open(OUT, "w"), indent=1)
    check_trainer()
    if rank == 0:
        json.dump(results, open(OUT, "w"), indent=1)


if __name__ == "__main__":
    main()

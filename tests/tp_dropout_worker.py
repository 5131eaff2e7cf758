"""Run by tests/launch/test_tp_dropout.py under the real `deepspeed` launcher (2 gloo ranks, AutoTP 2 = one tensor-parallel
group): dropout under tensor parallelism, several checks in one launch. Each rank writes what it measured to
OUT/rank<R>.json; the test compares the ranks and the references.

`python tp_dropout_worker.py OUT all`:
  reference   tiny OPT (dropout 0.1, attention_dropout 0), ZeRO-0: the TP run seeded as the trainer seeds it
              (memtrain.train.rng) against a plain single-process copy of the same weights seeded torch.manual_seed
              (seed): loss and every gradient (the TP shards gathered) of one step
  masks       attention_dropout 0.1 too (eager attention): layer 0's attention-probability masks on each rank (its
              own heads), with the fork installed and without it; the loss on each rank
  recompute   the same model under full recompute, DeepSpeed's reentrant checkpoint and torch's non-reentrant one:
              gradients against no recompute, same seed (a recompute must draw the masks its forward drew)
  trainer     src/train.py's train() on tiny OPT (dropout 0.1, attention_dropout 0.1), ds_configs/zero3_tp2_ckpt.json,
              3 steps, a model checkpoint after each: each rank's loss of each step (engine.backward recorded)
  resumed     then the trainer again, --resume on a copy of that run cut back to step 1 (tests/conftest.py's
              cut_back, made by rank 0), the same recording
`python tp_dropout_worker.py OUT resume RUN_DIR`: the trainer only, --resume RUN_DIR, the same recording.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from families import FAMILIES  # noqa: E402

from memtrain.config.recipe import ModelSection  # noqa: E402
from memtrain.model.build import build_config, build_model  # noqa: E402
from memtrain.model.data import RandomTokens  # noqa: E402
from memtrain.train import parallel, rng  # noqa: E402
from memtrain.train.trainer import _skip_shm_comm_op  # noqa: E402

SEQ, MBS, VOCAB, SEED = 32, 2, 257, 1234
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
results: dict = {}


def opt(attention_dropout: float, eager: bool = False):
    cfg = {**FAMILIES["opt"], "dropout": 0.1, "attention_dropout": attention_dropout}
    if eager:
        cfg["attn_implementation"] = "eager"
    section = ModelSection(type="opt", config=cfg)
    return section, build_config(section, VOCAB, SEQ)


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 10**9}


def tp_engine(section, config):
    """A ZeRO-0 AutoTP engine (gradients stay in .grad) with memtrain's forks, and a plain copy of its weights."""
    import copy

    import deepspeed

    torch.manual_seed(0)
    model = build_model(section, config).train()
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    layout = parallel.layout(engine)
    installed = rng.install(engine.module, config, layout, engine.device)
    return engine, ref, layout, installed


def full_grads(module) -> dict:
    """Every parameter's gradient, the TP shards gathered along the dimension AutoTP split."""
    import deepspeed.comm as dist
    from deepspeed.utils import groups

    group, tp = groups.get_tensor_model_parallel_group(), groups.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in module.named_parameters():
        g = p.grad.contiguous()
        out[name] = g
        if getattr(p, "ds_is_replicated", None) is False or _sharded(module, name):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=group)
            out[name] = parts
    return out


def _sharded(module, name: str) -> bool:
    from deepspeed.module_inject.layers import TensorParallel_Layer

    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return isinstance(owner, TensorParallel_Layer) and not getattr(owner, "is_replicated", lambda: False)()


def max_grad_diff(tp_grads: dict, ref) -> tuple:
    """The largest difference against the reference's gradients, relative to its largest gradient (k_proj's bias
    has none, mathematically: rounding only), and where it is."""
    worst, scale = (0.0, None), max(p.grad.abs().max().item() for p in ref.parameters())
    for name, p in ref.named_parameters():
        g, want = tp_grads[name], p.grad
        if isinstance(g, list):  # shards: the dimension whose size differs from the whole
            dim = next((d for d in range(want.dim()) if g[0].shape[d] != want.shape[d]), None)
            g = g[0] if dim is None else torch.cat(g, dim)  # replicated after all (bias of a row-parallel layer)
        assert g.shape == want.shape, (name, g.shape, want.shape)
        worst = max(worst, ((g - want).abs().max().item() / scale, name))
    return worst


def check_reference() -> None:
    """Residual dropout 0.1, attention dropout 0: the masks are defined to match one process's."""
    section, config = opt(0.0)
    engine, ref, layout, installed = tp_engine(section, config)
    ids = RandomTokens(VOCAB, SEQ, 5).batch(0, 0, 0, 1, MBS, 1)
    rng.seed_everything(SEED, layout, int(os.environ["RANK"]))  # as the trainer seeds its steps
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    torch.manual_seed(SEED)  # the single process: rank 0 of a world of one
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    results["reference"] = {"loss": loss.item(), "ref_loss": ref_loss.item(), "installed": installed,
                            "grad_rel_diff": max_grad_diff(full_grads(engine.module), ref),
                            "layout": [layout.tp, layout.tp_rank, layout.dp_rank, layout.dp_size]}
    engine.destroy()


def _attention_masks(module, ids) -> list:
    """One forward: the zero pattern of each 4-D dropout (attention probabilities, eager) on this rank."""
    import torch.nn.functional as F

    seen, dropout = [], F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        y = dropout(x, p, training, inplace)
        if x.dim() == 4 and training and p > 0:
            live = x != 0  # not the causal mask's zeros
            seen.append({"dropped": (live & (y == 0)).flatten().tolist(), "live": int(live.sum())})
        return y

    F.dropout = recording
    try:
        loss = module(input_ids=ids, labels=ids).loss
    finally:
        F.dropout = dropout
    return seen, loss.item()


def check_masks_and_recompute() -> None:
    from memtrain.config.recipe import ACSection
    from memtrain.config.recompute_spec import resolve_recompute
    from memtrain.recompute import partition
    from memtrain.recompute.hooks import apply_plan, configure_deepspeed_ac, remove_plan
    from memtrain.recompute.policy import build_plan

    section, config = opt(0.1, eager=True)
    engine, _, layout, installed = tp_engine(section, config)
    module, rank = engine.module, int(os.environ["RANK"])
    ids = RandomTokens(VOCAB, SEQ, 6).batch(0, 0, 0, 1, MBS, 1)
    rng.seed_everything(SEED, layout, rank)
    masks, loss = _attention_masks(module, ids)
    # the same without the forks: every rank of the group would draw one pattern for its own heads
    saved = {m: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in module.modules() if m._forward_pre_hooks}
    for m in saved:
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    rng.seed_everything(SEED, layout, rank)
    unforked, _ = _attention_masks(module, ids)
    for m, (pre, post) in saved.items():
        m._forward_pre_hooks.update(pre)
        m._forward_hooks.update(post)
    results["masks"] = {"installed": installed, "forks": rng.forks(module), "layer0": masks[0]["dropped"],
                        "live": masks[0]["live"], "unforked_layer0": unforked[0]["dropped"], "loss": loss,
                        "count": len(masks)}

    grads, losses = {}, {}
    for name, backend, reentrant in (("none", None, True), ("deepspeed", "deepspeed", True),
                                     ("torch", "torch", False)):
        remove_plan(module)
        if backend is not None:
            cfg = {"activation_checkpointing": {"partition_activations": backend == "deepspeed"}}
            spec = resolve_recompute(cfg, ACSection(policy="full", backend=backend, deepspeed_reentrant=reentrant),
                                     "cuda", 2)
            plan = build_plan(spec, config.num_hidden_layers)
            apply_plan(module, plan)
            if backend == "deepspeed":
                configure_deepspeed_ac(spec, config.num_hidden_layers, partition.tp_mpu(plan, 2))
        rng.seed_everything(SEED, layout, rank)
        out = module(input_ids=ids, labels=ids).loss
        out.backward()
        losses[name] = out.item()
        grads[name] = {n: p.grad.clone() for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
    remove_plan(module)
    results["recompute"] = {
        "losses": losses,
        "grad_max_diff": {name: max((grads[name][n] - g).abs().max().item() for n, g in grads["none"].items())
                          for name in ("deepspeed", "torch")},
        "grad_max": max(g.abs().max().item() for g in grads["none"].values())}
    engine.destroy()


def run_trainer(run_dir: str, resume: bool, key: str = "trainer") -> None:
    """The real trainer; engine.backward records each rank's loss of each micro-step (a test's own wrapper)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from memtrain.config.args import parse_args
    from memtrain.train.trainer import train

    losses, forks, backward = [], [], DeepSpeedEngine.backward

    def recording(self, loss, *args, **kwargs):
        losses.append(loss.item())
        if not forks:
            forks.append(rng.forks(self.module))
        return backward(self, loss, *args, **kwargs)

    DeepSpeedEngine.backward = recording
    cfg = {**FAMILIES["opt"], "dropout": 0.1, "attention_dropout": 0.1}
    argv = ["--deepspeed", os.path.join(ROOT, "ds_configs", "zero3_tp2_ckpt.json"), "--run-dir", run_dir,
            "--max-steps", "3", "--set", "model.type=opt", "--set", f"model.config={json.dumps(cfg)}",
            "--set", "data.random_tokens=true", "--set", f"data.seq_len={SEQ}", "--set", "train.micro_batch_size=2",
            "--set", "train.save_interval=1", "--set", "train.keep_last=3", "--set", "train.log_every=1",
            "--set", "train.collective_timeout_s=120"]
    try:
        summary = train(parse_args(argv + (["--resume"] if resume else [])))
    finally:
        DeepSpeedEngine.backward = backward
    results[key] = {"losses": losses, "forks": forks[0] if forks else None, "status": summary["status"],
                          "final_loss": summary["final_loss"]}


def cut_back_to_step1(run_dir: str, copy: str) -> str:
    """Rank 0 copies the finished run as if stopped after step 1; the other rank waits for its `.ready` file (the
    trainer closed the process group)."""
    import time
    from pathlib import Path

    ready = Path(copy + ".ready")
    if os.environ["RANK"] == "0":
        from conftest import cut_back

        cut_back(Path(run_dir), Path(copy), 1)
        ready.touch()
    deadline = time.time() + 300
    while not ready.exists():
        assert time.time() < deadline, "rank 0 never cut the run back"
        time.sleep(0.1)
    return copy


def main() -> None:
    import deepspeed

    gc.freeze()  # the imports' objects out of the collector's sight: DeepSpeed's gc.collect in each engine's set-up scans the rest
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
    out, mode = args[0], args[1]
    torch.set_num_threads(1)
    _skip_shm_comm_op()
    rank = os.environ["RANK"]

    def write():
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)

    if mode == "all":
        deepspeed.init_distributed(verbose=False)
        check_reference()
        check_masks_and_recompute()
        write()
        run_trainer(os.path.join(out, "run"), resume=False)
        write()
        resumed = cut_back_to_step1(os.path.join(out, "run"), os.path.join(out, "resumed"))
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)  # a fresh rendezvous for the next run
        run_trainer(resumed, resume=True, key="resumed")
    else:
        run_trainer(args[2], resume=True)
    write()


if __name__ == "__main__":
    main()

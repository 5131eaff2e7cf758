"""Run by tests/launch/test_long_context.py under make train's launcher with 2 gloo ranks.

One launch, several engines in one process group, each compared against a plain-torch reference
that runs first on every rank (one process, whole batches, full sequences, HF's own forward and
loss, no DeepSpeed), before Ulysses replaces transformers' sdpa for the process:

  dp-fused-z3     ZeRO-3, 2 data-parallel ranks, train.loss fused, tied embeddings, ignored labels
  dp-standard-z3  the same with train.loss standard (the harness's own sanity check)
  sp-fused-tiled-z3  ZeRO-3, parallel.sequence 2, fused, tiled_mlp 2
  sp-standard-z2     ZeRO-2, parallel.sequence 2, standard
  sp-fused-z1        ZeRO-1, parallel.sequence 2, fused
  sp-lora-z3         ZeRO-3, parallel.sequence 2, fused, LoRA adapters (model.lora; only they train)
  sp-<family>-z3     ZeRO-3, parallel.sequence 2, standard, for each family of tests/families.py with 2 key/value
                     heads that Ulysses runs (tests/zero3_worker.py runs the multi-head ones)

Each engine takes one SGD step (lr 1, no clipping); the parameter change is -grad, gathered and
compared with the reference's gradient. Writes one JSON line per case to the last argument on rank 0.
Then memtrain's trainer runs 4 steps with parallel.sequence 2 into <that path>.run.
"""
import gc
import json
import sys

import torch

import deepspeed
import deepspeed.comm as dist

from memtrain.config.recipe import load_recipe
from memtrain.model.build import build_config, build_model
from memtrain.model.lora import add_lora
from memtrain.train import long_context
from conftest import EVAL_PATHS
from families import SP_CONFIG, SP_GQA, overrides

SEQ, MBS, VOCAB = 64, 2, 300
OVERRIDES = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
             "model.config.tie_word_embeddings=true", f"model.config.vocab_size={VOCAB}",
             f"data.seq_len={SEQ}", f"train.micro_batch_size={MBS}"]


def recipe(*more):
    return load_recipe(None, OVERRIDES + list(more))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=g)


def labels_with_ignores(ids):
    labels = ids.clone()
    labels[:, :5] = -100
    labels[0, 30:40] = -100
    return labels


def family_recipe(family, *more):
    """The family's tiny config (tests/families.py) at this worker's shapes."""
    own = [f"model.config.{key}={value}" for key, value in SP_CONFIG.get(family, {}).items()]
    return load_recipe(None, [*overrides(family), f"model.config.vocab_size={VOCAB}", *own, f"data.seq_len={SEQ}",
                              f"train.micro_batch_size={MBS}", *more])


def sp_family_cases(families):
    """The families' references now (before a Ulysses registration replaces sdpa for the process); returns
    the function that runs each with parallel.sequence 2 and compares."""
    ids = batch(0)
    refs = {f: reference_grads(family_recipe(f), [(ids, ids)]) for f in families}

    def run():
        return [compare(f"sp-{f}-z3", refs[f], engine_grads(family_recipe(f, "parallel.sequence=2", "train.loss=standard"),
                                                          3, lambda sp: sp.slice_batch(ids)))
                for f in families]
    return run


def fresh_model(r):
    torch.manual_seed(0)
    model = build_model(r.model, build_config(r.model, VOCAB, SEQ))
    if r.model.lora is not None:  # the adapters' init draws from the same seeded stream in both
        add_lora(model, r.model.lora)
    return model


def reference_grads(r, batches):
    """Mean over batches of HF's loss gradient (what data-parallel averaging gives)."""
    model = fresh_model(r)
    losses = []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss / len(batches)
        loss.backward()
        losses.append(loss.item() * len(batches))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(losses) / len(losses)


def engine_grads(r, stage, feed):
    model = fresh_model(r)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ctx = long_context.prepare(model, r, stage)
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "sequence_parallel_size": r.parallel.sequence, "steps_per_print": 10**9}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=ctx.mpu)
    loss = engine(**feed(ctx.sp)).loss
    engine.backward(loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    grads = {}
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        for n, p in params.items():
            grads[n] = (before[n] - p.detach()).clone()
    value = loss.detach().clone()
    dist.all_reduce(value)
    engine.destroy()
    return grads, value.item() / dist.get_world_size(), ctx.loss


def compare(name, ref, got):
    ref_grads, ref_loss = ref
    grads, loss, used = got
    num = sum((grads[n] - g).pow(2).sum() for n, g in ref_grads.items()) ** 0.5
    den = sum(g.pow(2).sum() for g in ref_grads.values()) ** 0.5
    return {"case": name, "loss": loss, "ref_loss": ref_loss, "grad_rel_err": float(num / den), "loss_used": used}


def main():
    gc.freeze()  # the imports' objects out of the collector's sight: DeepSpeed's gc.collect in each engine's set-up scans the rest
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    out = []
    ids = [batch(i) for i in range(2)]
    dp_batches = [(x, labels_with_ignores(x)) for x in ids]
    # references first: Ulysses registration below replaces sdpa for the whole process
    ref_dp = reference_grads(recipe(), dp_batches)
    ref_sp = reference_grads(recipe(), [(ids[0], ids[0])])
    lora = ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,down_proj]"]
    ref_lora = reference_grads(recipe(*lora), [(ids[0], ids[0])])
    families = sp_family_cases(SP_GQA)

    def dp_feed(sp):
        x, labels = dp_batches[rank]
        return {"input_ids": x, "labels": labels}

    def sp_feed(sp):
        return sp.slice_batch(ids[sp.data_rank])

    out.append(compare("dp-fused-z3", ref_dp, engine_grads(recipe("train.loss=fused"), 3, dp_feed)))
    out.append(compare("dp-standard-z3", ref_dp, engine_grads(recipe("train.loss=standard"), 3, dp_feed)))
    sp2 = ["parallel.sequence=2"]
    out.append(compare("sp-fused-tiled-z3", ref_sp,
                       engine_grads(recipe(*sp2, "train.loss=fused", "activation_checkpointing.tiled_mlp=2"), 3, sp_feed)))
    out.append(compare("sp-standard-z2", ref_sp, engine_grads(recipe(*sp2, "train.loss=standard"), 2, sp_feed)))
    out.append(compare("sp-fused-z1", ref_sp, engine_grads(recipe(*sp2, "train.loss=fused"), 1, sp_feed)))
    out.append(compare("sp-lora-z3", ref_lora, engine_grads(recipe(*sp2, *lora, "train.loss=fused"), 3, sp_feed)))
    out.extend(families())

    # memtrain's slices against DeepSpeed's UlyssesSPDataLoaderAdapter (an independent implementation)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from memtrain.train.sequence_parallel import _REGISTERED
    mpu = next(iter(_REGISTERED.values()))
    full = {"input_ids": ids[0], "labels": ids[0],
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()}
    adapter = UlyssesSPDataLoaderAdapter([full], mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group(),
                                         2, device="cpu")
    theirs = next(iter(adapter))
    from memtrain.train.sequence_parallel import SequenceParallel
    mine = SequenceParallel(size=2, rank=mpu.get_sequence_parallel_rank()).slice_batch(ids[0])
    same = all(torch.equal(theirs[k], mine[k]) for k in ("input_ids", "position_ids", "shift_labels"))
    flags = torch.tensor([float(same)])
    dist.all_reduce(flags)
    out.append({"case": "slices-match-adapter", "ranks_agreeing": flags.item()})
    if rank == 0:
        with open(sys.argv[-1], "w") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    # last: memtrain's own trainer with parallel.sequence 2 (it ends the process group itself)
    from memtrain.config.args import parse_args
    from memtrain.train.trainer import train
    run_dir = sys.argv[-1] + ".run"
    train(parse_args(["--deepspeed", "ds_configs/zero3_ckpt.json", "--run-dir", run_dir, "--overwrite",
                      *[x for o in OVERRIDES + ["parallel.sequence=2", "data.max_bytes=100000", EVAL_PATHS,
                                                "train.eval_batches=2", "train.max_steps=4",
                                                "train.metric_warmup_steps=1", "train.log_every=1",
                                                ] for x in ("--set", o)]]))


if __name__ == "__main__":
    main()

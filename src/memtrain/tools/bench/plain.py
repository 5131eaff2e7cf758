"""The plain-PyTorch baseline the bench compares against: no DeepSpeed, one device, random tokens.

`python -m memtrain.tools.bench.plain --setup torch:noac [--recipe YAML] [--set k=v ...] --steps N
--warmup N --out FILE` writes one JSON object to FILE: the measurements, or `"oom": true`.

It is deliberately not the trainer: it is the common denominator (what a user gets from
transformers and torch alone), so it keeps float32 master weights under bf16 autocast and uses
torch's fused AdamW. Timing is the trainer's: CUDA events over the steps after warm-up, one
host sync at the end; peak = `torch.cuda.max_memory_allocated` over the whole run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from memtrain.recompute.policy import plan_for
from memtrain.recompute.hooks import apply_plan
from memtrain.model.data import RandomTokens, build_tokenizer, to_device
from memtrain.errors import ArgumentParser, cli_entry
from memtrain.train.faults import is_oom
from memtrain.units import GIB
from memtrain.train.metrics import IntervalTimer
from memtrain.recompute.meter import OpCounter
from memtrain.model.build import build_config, build_model
from memtrain.config.recipe import load_recipe
from memtrain.tools.bench.setups import Setup, parse_setup


def run(setup: Setup, recipe, steps: int, warmup: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:  # the cores this process may run on, as the trainer counts them
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(recipe.train.seed)
    config = build_config(recipe.model, build_tokenizer(recipe.data.tokenizer).vocab_size, recipe.data.seq_len)
    model = build_model(recipe.model, config).to(device)
    if setup.ac == "hf-ac":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif setup.ac == "sac":
        apply_plan(model, plan_for("op", config.num_hidden_layers, recipe.activation_checkpointing, backend="torch",
                                   op_save=["matmul", "attention"]))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr, fused=cuda)
    bf16 = cuda and torch.cuda.is_bf16_supported()
    mb, seq = recipe.train.micro_batch_size, recipe.data.seq_len
    data = RandomTokens(config.vocab_size, seq, recipe.train.seed)
    timer = IntervalTimer(device)
    ops = OpCounter()
    for step in range(warmup + steps):
        if step == warmup:
            timer.start()
            cpu = time.process_time()
        ids = to_device(data.batch(step, 0, 0, 1, mb, 1), device)
        # aten ops of one warm-up step (as the trainer's train.probe counts them), outside the timing
        with ops if step == warmup - 1 else nullcontext():
            with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    seconds = timer.stop()
    return {"tokens_per_s": steps * mb * seq / seconds, "step_s": seconds / steps,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "probe": {"cpu_s": (time.process_time() - cpu) / steps, "aten_ops": ops.ops if warmup else None}}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain.tools.bench.plain", description=__doc__.splitlines()[0])
    p.add_argument("--setup", default="torch:noac")
    p.add_argument("--recipe", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True, type=Path)
    return p


@cli_entry
def main(argv=None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    setup = parse_setup(args.setup)
    recipe = load_recipe(args.recipe, args.overrides)
    result = {"setup": setup.name, "label": setup.label, "micro_batch": recipe.train.micro_batch_size,
              "seq_len": recipe.data.seq_len, "world_size": 1,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "oom": False}
    try:
        result.update(run(setup, recipe, args.steps, args.warmup))
    except Exception as e:  # an OOM is a result (the micro-batch does not fit); anything else is not
        if not is_oom(e):
            raise
        result["oom"] = True
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

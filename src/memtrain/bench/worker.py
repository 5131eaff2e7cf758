"""One benchmark set-up in one process: build, train a few steps on random tokens, measure.

`python -m memtrain.bench.worker --setup NAME [--recipe YAML] [--set k=v ...] --steps N --warmup N
--out FILE` writes one JSON object to FILE: the measurements, or `"oom": true`.

Measured: the median step time over the steps after warm-up (tokens/s = micro-batch x sequence
/ step time), `torch.cuda.max_memory_allocated` over the whole run (peak GiB), the bytes saved
for backward and still on the device at the end of one forward (`ActivationMeter`, as the
trainer's `memory/activation_gib`), the bytes memtrain's offload moved to host in that forward,
and on a GPU the bytes the forward left allocated (`memory_allocated` after minus before).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ..ac import DEFAULT_OP_SAVE, apply_plan, build_plan, configure_deepspeed_ac, effective_policy
from ..data import build_tokenizer
from ..ds_config import ac_section, load_ds_config, resolve_ds_config
from ..errors import cli_entry
from ..metrics import GIB, ActivationMeter, synchronize
from ..model import build_config, build_model
from ..recipe import Recipe, load_recipe
from .setups import Setup, parse_setup

MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")  # the bench writes no event files


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _plain(setup: Setup, recipe: Recipe, config, device: torch.device):
    model = build_model(recipe.model, config).to(device)
    if setup.ac == "hf-ac":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif setup.ac == "sac":
        apply_plan(model, build_plan("op", "torch", ac_section({}), config.num_hidden_layers,
                                     section=recipe.activation_checkpointing.model_copy(
                                         update={"op_save": list(DEFAULT_OP_SAVE)})))
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    bf16 = cuda and torch.cuda.is_bf16_supported()

    def forward(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext():
            return model(input_ids=ids, labels=ids).loss

    def backward_and_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, backward_and_step, None


def _zero3(setup: Setup, recipe: Recipe, config, ds_path: str):
    import deepspeed

    from ..trainer import single_process_env

    raw = copy.deepcopy(load_ds_config(ds_path))
    for key in MONITORS:
        raw.pop(key, None)
    raw.setdefault("zero_optimization", {})["stage"] = 3
    raw.setdefault("activation_checkpointing", {})["cpu_checkpointing"] = setup.cpu_checkpointing
    section = recipe.activation_checkpointing.model_copy(
        update={"policy": setup.ac, "backend": setup.backend, "cpu_checkpointing_impl": setup.impl})
    plan = build_plan(effective_policy(section, raw), section.backend, ac_section(raw), config.num_hidden_layers,
                      section=section)
    single_process_env()
    deepspeed.init_distributed(verbose=False)
    ds_config = resolve_ds_config(raw, recipe, 1, Path(tempfile.gettempdir()), plan.num_recomputed)  # no monitors
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = build_model(recipe.model, config)
    if plan.backend == "deepspeed":
        configure_deepspeed_ac(ds_config, plan)
    apply_plan(model, plan)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def forward(ids):
        return engine(input_ids=ids, labels=ids).loss

    def backward_and_step(loss):
        engine.backward(loss)
        engine.step()

    return forward, backward_and_step, plan


def run(setup: Setup, recipe: Recipe, steps: int, warmup: int, ds_path: str) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:  # the CPU smoke shapes gain nothing from threads, and on a busy machine spinning ones stall
        torch.set_num_threads(1)
    torch.manual_seed(recipe.train.seed)
    config = build_config(recipe.model, build_tokenizer(recipe.data.tokenizer).vocab_size, recipe.data.seq_len)
    mb, seq = recipe.train.micro_batch_size, recipe.data.seq_len
    if setup.zero3:
        forward, backward_and_step, plan = _zero3(setup, recipe, config, ds_path)
    else:
        forward, backward_and_step, plan = _plain(setup, recipe, config, device)
    ids = torch.randint(0, config.vocab_size, (mb, seq), device=device)  # throughput does not care what it reads
    meter = ActivationMeter()
    step_s, retained = [], 0
    for step in range(warmup + steps):
        measured = step == warmup  # memory of one steady-state forward
        synchronize()
        start = time.perf_counter()
        before = torch.cuda.memory_allocated() if cuda else 0
        with meter.measure() if measured else nullcontext():
            loss = forward(ids)
        if measured and cuda:
            retained = torch.cuda.memory_allocated() - before
        backward_and_step(loss)
        del loss
        synchronize()
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
    median = statistics.median(step_s)
    return {
        "tokens_per_s": mb * seq / median,
        "step_s": median,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "activation_gib": meter.bytes / GIB,
        "offloaded_gib": meter.offloaded_bytes / GIB,
        "forward_retained_gib": retained / GIB if cuda else None,
        "plan": plan.describe() if plan is not None else None,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memtrain.bench.worker", description=__doc__.splitlines()[0])
    p.add_argument("--setup", required=True)
    p.add_argument("--recipe", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--deepspeed", default="ds_configs/zero3_ckpt.json")
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
              "seq_len": recipe.data.seq_len, "steps": args.steps, "warmup": args.warmup,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "oom": False}
    try:
        result.update(run(setup, recipe, args.steps, args.warmup, args.deepspeed))
    except Exception as e:  # an OOM is a result (the micro-batch does not fit); anything else is not
        if not is_oom(e):
            raise
        result["oom"] = True
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

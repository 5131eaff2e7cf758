"""The DeepSpeed JSONs users bring (tests/ds_corpus/: transformers', accelerate's, LLaMA-Factory's,
axolotl's, DeepSpeedExamples', LLaVA's, InternVL's styles): each one either trains, or is rejected
with one line naming the key before any worker starts. Nothing is left to a traceback.

Every file goes through the full preflight in this process (cheap: no launcher). Trained through
the real launcher on 2 CPU ranks (a launch costs ~30 s here, so only these):
- noopt_zero3_ac.json and auto_everywhere_ac.json: the same job without and with optimizer/scheduler
  sections. memtrain's own AdamW + schedule must give DeepSpeed's own AdamW + WarmupCosineLR losses.
- accelerate_zero2_noopt.json: ZeRO-2 without an optimizer ("zero stage 2 requires an optimizer").
The other "train" files were trained the same way by hand, 2 steps on 2 CPU ranks (2026-11-23, this
2-core box): llamafactory_ds_z0 (ZeRO-0), llamafactory_ds_z3 (ZeRO-3), axolotl_zero3_bf16 (bf16),
megatron_ac_contiguous (DeepSpeed's checkpoint with contiguous_memory_optimization), internvl_zero1,
dse_zero2_explicit. The two CPU-offload ones pass preflight but are not trained here: an offloaded
optimizer needs DeepSpeed's CPU Adam, a JIT build of minutes (preflight warns of it up front).
"""

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import FAST, ROOT
from memtrain.config.args import parse_args
from memtrain.config.ds_config import auto_paths, model_hidden_size, resolve_ds_config
from memtrain.errors import UserError
from memtrain.train.preflight import resolve_run

CORPUS = ROOT / "tests" / "ds_corpus"
STEPS = ["--max-steps", "3"]


def _aio_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


# name: ("train", why) or ("reject", the key the one line must name, why)
EXPECT = {
    "accelerate_zero2_noopt.json": ("train", "no optimizer section: memtrain builds AdamW (ZeRO-2)"),
    "accelerate_zero3_plugin_auto.json": ("train", "the \"auto\"s accelerate's DeepSpeed plugin fills: 16-bit gather "
                                          "on save, offload devices"),
    "auto_everywhere_ac.json": ("train", "every \"auto\" transformers fills, plus an AC section"),
    "axolotl_zero3_bf16.json": ("train", "bf16 runs on DeepSpeed's CPU accelerator"),
    "bad_beta.json": ("reject", "optimizer.params.betas", "beta2 = 1.5 is outside [0, 1)"),
    "bad_optimizer_key.json": ("reject", "optimizer.params.momentum", "AdamW has no momentum"),
    # DeepSpeed's CPU accelerator supports fp16 on CPUs with AVX512-FP16 (e.g. Sapphire Rapids), not on others
    "dse_zero1_fp16.json": (("train", "fp16 on a CPU with AVX512-FP16") if _fp16_supported() else
                            ("reject", "fp16.enabled", "fp16 is not supported on this CPU")),
    "dse_zero2_explicit.json": ("train", "explicit values that agree with the recipe"),
    "hf_zero2_offload.json": ("train", "fp16 \"auto\" is off here; CPU optimizer offload (CPU Adam JIT build)"),
    "hf_zero3_offload.json": ("train", "model-sized bucket \"auto\"s; CPU offload (CPU Adam JIT build)"),
    "internvl_zero1.json": ("train", "warm-up lr \"auto\" is filled (DeepSpeed: str - str)"),
    "llamafactory_ds_z0.json": ("train", "ZeRO-0 without an optimizer"),
    "llamafactory_ds_z3.json": ("train", "ZeRO-3 without an optimizer"),
    "megatron_ac_contiguous.json": ("train", "contiguous_memory_optimization: number_checkpoints filled"),
    "noopt_zero3_ac.json": ("train", "no optimizer/scheduler sections, AC section"),
    "nvme_no_path.json": ("reject", "offload_param.nvme_path", "NVMe offload needs a path"),
    "nvme_with_path.json": (("train", "NVMe offload with a writable path and async_io") if _aio_available() else
                            ("reject", "offload_param.device", "DeepSpeed's async_io op cannot build (no libaio)")),
    "unfillable_auto.json": ("reject", "zero_optimization.sub_group_size", "an \"auto\" nobody fills"),
}


def test_corpus_is_complete():
    assert sorted(p.name for p in CORPUS.glob("*.json")) == sorted(EXPECT)
    assert len(EXPECT) >= 12


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_preflight_decides_each_json(name):
    argv = ["--deepspeed", str(CORPUS / name), "--run-dir", str(ROOT / "runs" / "never"), *FAST, *STEPS]
    expect = EXPECT[name]
    args = parse_args(argv)
    if expect[0] == "reject":
        with pytest.raises(UserError) as e:
            resolve_run(args, 2)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{CORPUS / name}: ") and expect[1] in line, (line, expect)
        return
    checked = resolve_run(args, 2)
    resolved = resolve_ds_config(args.ds_config, args.recipe, 2, ROOT / "runs" / "never",
                                 len(checked.plan.offload_units), hidden_size=model_hidden_size(checked.config))
    assert auto_paths(resolved) == [], f"{name}: \"auto\" left in the resolved JSON"


def _learning_rates(recipe) -> list[float]:
    """The learning rate of each step of memtrain's own schedule, called as DeepSpeed's engine calls it (built on the
    optimizer, then step() after each optimizer step)."""
    import torch

    from memtrain.train.optimizer import build_schedule

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.train.lr)
    schedule = build_schedule(recipe)(optimizer)
    rates = []
    for _ in range(recipe.train.max_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_no_warmup_trains_at_the_full_learning_rate_from_step_1():
    """train.warmup_steps 0: step 1 at train.lr, a cosine to train.min_lr at the last step (DeepSpeed's
    WarmupCosineLR would give 0 at steps 1 and 2: a 2-step LoRA run would end with lora_B all zero)."""
    import math

    recipe = parse_args(["--set", "train.warmup_steps=0", "--max-steps", "5", "--set", "train.min_lr=1e-4"]).recipe
    lr, low = recipe.train.lr, recipe.train.min_lr
    assert _learning_rates(recipe) == pytest.approx([low + (lr - low) * (1 + math.cos(math.pi * k / 4)) / 2
                                                     for k in range(5)])
    warm = _learning_rates(parse_args(["--max-steps", "8"]).recipe)  # warm-up 4: DeepSpeed's own class, as before
    assert warm[:2] == [0.0, 0.0] and 0 < warm[2] < warm[3] < warm[4] and max(warm) <= lr


def test_auto_fills_follow_transformers():
    """The values transformers' HfTrainerDeepSpeedConfig puts in (its formulas, restated here)."""
    args = parse_args(["--deepspeed", str(CORPUS / "hf_zero3_offload.json"), *FAST, *STEPS,
                       "--set", "train.warmup_steps=0", "--set", "train.adam_eps=1e-6"])
    cfg = resolve_ds_config(args.ds_config, args.recipe, 2, ROOT / "runs" / "never", 4, hidden_size=128)
    t = args.recipe.train
    assert cfg["optimizer"]["params"] == {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": t.weight_decay}
    # unlike transformers' 0: with no warm-up the warm-up DeepSpeed's WarmupDecayLR always takes starts at train.lr
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": t.lr, "warmup_max_lr": t.lr, "warmup_num_steps": 1,
                                          "total_num_steps": 3}
    warm = parse_args(["--deepspeed", str(CORPUS / "hf_zero3_offload.json"), *FAST, *STEPS])
    assert resolve_ds_config(warm.ds_config, warm.recipe, 2, ROOT / "runs" / "never", 4,
                             hidden_size=128)["scheduler"]["params"]["warmup_min_lr"] == 0.0
    z = cfg["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (128 * 128, int(0.9 * 128 * 128), 1280)
    assert cfg["train_batch_size"] == 4 * 2 and cfg["gradient_clipping"] == t.grad_clip
    assert cfg["fp16"]["enabled"] is False


def test_number_checkpoints_counts_checkpoint_calls(tmp_path):
    """contiguous_memory_optimization: number_checkpoints "auto" = checkpoint calls per forward,
    counted independently here by wrapping the forward of every checkpointed unit."""
    import torch

    from memtrain.model.build import build_config, build_model
    from memtrain.recompute.hooks import apply_plan, checkpoint_calls
    from memtrain.recompute.policy import plan_for
    from memtrain.config.recipe import load_recipe

    recipe = load_recipe(None, ["model.config.num_hidden_layers=6"])
    config = build_config(recipe.model, 257, 16)
    cases = {"full": {}, "sqrt": {}, "every:2": {}, "selective:mlp": {},
             "modules": {"modules": ["model.layers.*.mlp"]}}
    for policy, keys in cases.items():
        model = build_model(recipe.model, config)
        plan = plan_for(policy, 6, backend="torch", **keys)
        apply_plan(model, plan)
        calls = []
        real = torch.utils.checkpoint.checkpoint

        def counting(fn, *a, **k):
            calls.append(1)
            return real(fn, *a, **k)

        torch.utils.checkpoint.checkpoint = counting
        try:
            ids = torch.randint(0, 257, (1, 16))
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            torch.utils.checkpoint.checkpoint = real
        assert checkpoint_calls(model, plan) == len(calls) > 0, policy


def test_stale_build_lock_is_cleared_live_one_kept(tmp_path, monkeypatch):
    """A lock left by a killed op build is removed with one line; one with a live build is kept."""
    import os
    import subprocess
    import time

    from memtrain.config.ds_checks import clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = time.time() - 300
    for op in ("stale_op", "live_op"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").write_text("")
        os.utime(tmp_path / op / "lock", (old, old))
    builder = subprocess.Popen(["sleep", "60"], cwd=tmp_path / "live_op")  # stands for ninja in the op's folder
    try:
        lines = clear_stale_build_locks()
    finally:
        builder.kill()
        builder.wait()
    assert len(lines) == 1 and "stale_op/lock" in lines[0]
    assert not (tmp_path / "stale_op" / "lock").exists() and (tmp_path / "live_op" / "lock").exists()


def test_on_a_shared_filesystem_a_lock_is_stale_only_when_its_folder_is_quiet(tmp_path, monkeypatch):
    """Another node's live build has no process in this node's /proc: on a shared filesystem a lock goes only
    when it and its build folder have been untouched for SHARED_MIN_QUIET_S; a build folder written 10 s ago
    (another node's ninja at work) keeps its 300-s-old lock, which the local rule alone would remove."""
    import os
    import time
    from pathlib import Path

    from memtrain.config.ds_checks import SHARED_MIN_QUIET_S, clear_stale_build_locks, filesystem_type

    assert filesystem_type(Path("/proc/self")) == "proc"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    now = time.time()
    for op, lock_age, folder_age in (("busy_op", 300, 10), ("dead_op", SHARED_MIN_QUIET_S + 60, SHARED_MIN_QUIET_S + 60)):
        (tmp_path / op).mkdir()
        for name, age in (("lock", lock_age), ("build.ninja", folder_age)):
            (tmp_path / op / name).write_text("")
            os.utime(tmp_path / op / name, (now - age, now - age))
        os.utime(tmp_path / op, (now - folder_age, now - folder_age))
    lines = clear_stale_build_locks(shared=True)
    assert len(lines) == 1 and "dead_op/lock" in lines[0] and "on a shared filesystem" in lines[0]
    assert (tmp_path / "busy_op" / "lock").exists() and not (tmp_path / "dead_op" / "lock").exists()
    assert len(clear_stale_build_locks(shared=False)) == 1  # the local rule: no live process here, 300 s old


def test_explain_config_says_what_each_key_does(capsys):
    from memtrain.tools.explain_config import main

    main(["--deepspeed", str(CORPUS / "megatron_ac_contiguous.json"), *FAST, *STEPS])
    out = capsys.readouterr().out.splitlines()
    line = {ln.split(" = ")[0]: ln for ln in out if " = " in ln}
    assert len(line) == 19  # one per key of the JSON
    assert line["optimizer.params.lr"].endswith('filled 0.003 from train.lr')
    assert line["train_batch_size"].endswith("filled 8 from micro batch x grad accum x world size / parallel.sequence")
    assert "no-op here: nothing to shard: no tensor-parallel group" in line["activation_checkpointing.partition_activations"]
    assert line["zero_optimization.stage"].endswith("in effect")
    assert "filled 4 from the AC plan's checkpoint calls" in line["activation_checkpointing.number_checkpoints"]
    main(["--deepspeed", str(CORPUS / "dse_zero1_fp16.json"), *FAST, *STEPS])
    out = capsys.readouterr().out.splitlines()
    fp16 = next(ln for ln in out if ln.startswith("fp16.enabled = true"))
    if _fp16_supported():  # this CPU has AVX512-FP16: DeepSpeed's CPU accelerator runs fp16
        assert fp16.endswith("in effect")
    else:
        assert "rejected: fp16.enabled: true, but this machine's accelerator (cpu) does not support fp16" in fp16
    assert any("optimizer.params.lr = 0.00015: in effect (overrides the recipe's train.lr=0.003)" == ln for ln in out)


def test_skipped_steps_warning_threshold():
    from memtrain.train.loss_scale import skipped_warning

    assert skipped_warning(5, 100) is None  # 5% exactly: fine
    assert "6 of 100 optimizer steps (6%) were skipped" in skipped_warning(6, 100)
    assert skipped_warning(0, 0) is None

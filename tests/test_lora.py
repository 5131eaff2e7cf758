"""model.lora end to end (memtrain.model.lora): a tiny Llama saved as a local pretrained directory, LoRA under
ZeRO-3 + recompute on 2 CPU ranks with the real launcher. final/ holds the merged model and final/adapter the
adapters in peft's format: the pretrained base plus that adapter, loaded by peft itself, gives the merged model's
logits (so the base stayed frozen and the merge is right); a stopped run resumes to a straight run's losses.
Gradients against a plain peft model: tests/test_zero3_hooks.py."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import FAST, ROOT, assert_ok, cut_back, run_train
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.memory import estimate as mm
from memtrain.model.build import build_config, build_model
from memtrain.model.lora import add_lora
from memtrain.tools.tb import read_scalars

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    section = ModelSection(type="llama", config=LLAMA)
    torch.manual_seed(0)
    base = build_model(section, build_config(section, vocab_size=257, seq_len=64))
    base.save_pretrained(tmp / "base")
    args = [*FAST, "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--set", f"model.pretrained={tmp / 'base'}", "--set", "model.config={}",
            "--set", "model.lora.r=4", "--set", "model.lora.target_modules=[q_proj,v_proj,down_proj]",
            "--set", "train.save_interval=2", "--set", "train.lr=1e-2"]
    straight = tmp / "straight"
    first = run_train([*args, "--max-steps", "6", "--run-dir", str(straight)], nproc=2)
    assert_ok(first)
    stopped = cut_back(straight, tmp / "stopped", 4)
    resumed = run_train([*args, "--max-steps", "6", "--run-dir", str(stopped), "--resume"], nproc=2)
    assert_ok(resumed)
    return tmp, first


def test_final_holds_the_merged_model_and_the_adapter_that_reproduces_it(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, first = runs
    assert "trainable parameters: " in first.stdout and "LoRA r=4 alpha=16 on q_proj, v_proj, down_proj" in first.stdout
    final = tmp / "straight" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain transformers model
    base = AutoModelForCausalLM.from_pretrained(tmp / "base").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base"), final / "adapter").eval()
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got, untouched = (m(input_ids=ids).logits for m in (merged, adapted, base))
    assert (got - want).abs().max().item() < 1e-4
    assert (want - untouched).abs().max().item() > 1e-3  # the adapters learned something
    # python -m memtrain export of the last model checkpoint writes the same merged model and adapter
    from memtrain.tools.export import export

    out = export(tmp / "straight", 6, tmp / "exported")
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    assert (exported - want).abs().max().item() < 1e-4


def test_a_stopped_lora_run_resumes_to_the_straight_runs_losses(runs):
    tmp, _ = runs
    ref = dict(read_scalars(tmp / "straight" / "tb")["train/loss"])
    got = dict(read_scalars(tmp / "stopped" / "tb")["train/loss"])
    assert json.loads((tmp / "stopped" / "summary.json").read_text())["status"] == "completed"
    assert [got[5], got[6]] == [ref[5], ref[6]]


def test_adapters_on_a_module_the_model_lacks_are_one_line():
    model = build_model(ModelSection(type="llama", config=LLAMA), build_config(ModelSection(type="llama", config=LLAMA),
                                                                              vocab_size=257, seq_len=64))
    with pytest.raises(UserError, match=r"^model.lora.target_modules: .*\(its linear layers: .*q_proj"):
        add_lora(model, load_recipe(None, ["model.lora.target_modules=[qkv]"]).model.lora)


def test_planner_lora_run_keeps_states_for_the_adapters_only():
    """The TinyLlama-1.1B layer shape (2 layers here, for time): the adapters' weights are counted, and gradients and
    Adam states are the adapters' only (make plan on the 22-layer recipe: see docs/fine-tuning.md)."""
    ds = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    recipe = load_recipe(str(ROOT / "recipes" / "llama-1b.yaml"), ["model.config.num_hidden_layers=2"])
    lora = load_recipe(str(ROOT / "recipes" / "llama-1b.yaml"), ["model.config.num_hidden_layers=2", "model.lora.r=16"])
    config = mm.model_and_config(recipe)
    full_t, lora_t = (mm.make_target(r, ds, 1, "cuda") for r in (recipe, lora))
    assert lora_t.trainable_params < 0.02 * lora_t.all_params
    full_profile, lora_profile = (mm.profile_activations(config, t, ("keep",)) for t in (full_t, lora_t))
    full_states, lora_states = mm.model_states(full_profile, ds, full_t), mm.model_states(lora_profile, ds, lora_t)
    assert lora_profile.num_params - full_profile.num_params == lora_t.trainable_params  # the adapters' weights
    assert lora_states.optimizer < 0.02 * full_states.optimizer and lora_states.grads < 0.02 * full_states.grads

"""model.lora end to end (memtrain.model.lora): a tiny Llama saved as a local pretrained directory, LoRA under
ZeRO-3 + recompute on 2 CPU ranks with the real launcher. final/ holds the merged model and final/adapter the
adapters in peft's format: the pretrained base plus that adapter, loaded by peft itself, gives the merged model's
logits (so the base stayed frozen and the merge is right); a stopped run resumes to a straight run's losses.
Gradients against a plain peft model: tests/launch/test_zero3_hooks.py."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.memory.profile import profile_activations
from memtrain.memory.states import model_states
from memtrain.memory.target import make_target, model_and_config
from memtrain.model.build import build_config, build_model
from memtrain.model.lora import add_lora


LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


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
    config = model_and_config(recipe)
    full_t, lora_t = (make_target(r, ds, 1, "cuda") for r in (recipe, lora))
    assert lora_t.trainable_params < 0.02 * lora_t.all_params
    full_profile, lora_profile = (profile_activations(config, t, ("keep",)) for t in (full_t, lora_t))
    full_states, lora_states = model_states(full_profile, ds, full_t), model_states(lora_profile, ds, lora_t)
    assert lora_profile.num_params - full_profile.num_params == lora_t.trainable_params  # the adapters' weights
    assert lora_states.optimizer < 0.02 * full_states.optimizer and lora_states.grads < 0.02 * full_states.grads


def test_what_trains_beside_the_adapters_goes_into_the_adapter_or_is_one_line():
    """model.lora.modules_to_save trains those modules whole and final/adapter keeps them with what train.trainable
    adds; a parameter inside an adapted layer cannot go there (one line); rsLoRA and DoRA reach peft."""
    from memtrain.model.freeze import saved_with_adapters, trainable_names
    from memtrain.model.lora import lora_config, trainable_patterns

    section = ModelSection(type="llama", config=LLAMA)
    recipe = load_recipe(None, ["model.lora.target_modules=[q_proj]", "model.lora.modules_to_save=[input_layernorm]",
                                "model.lora.use_rslora=true", "model.lora.use_dora=true"])
    lora = recipe.model.lora
    model = build_model(section, build_config(section, vocab_size=257, seq_len=64))
    add_lora(model, lora)
    trained = trainable_names(model, trainable_patterns(model, lora, ["lm_head.weight"]), [])
    assert {n for n in trained if "lora_" not in n} == {"lm_head.weight", "model.layers.0.input_layernorm.weight",
                                                       "model.layers.1.input_layernorm.weight"}
    assert saved_with_adapters(model, lora, ["lm_head.weight"]) == (
        "lm_head", "model.layers.0.input_layernorm", "model.layers.1.input_layernorm")
    with pytest.raises(UserError, match=r"^train.trainable: model.layers.0.self_attn.q_proj.base_layer.weight trains "
                                        r"beside the LoRA adapters but sits in model.layers.0.self_attn.q_proj, a layer "
                                        r"LoRA adapts"):
        saved_with_adapters(model, lora, ["model.layers.0.self_attn.q_proj.base_layer.weight"])
    with pytest.raises(UserError, match=r"^model.lora.modules_to_save: 'nowhere' names no module"):
        trainable_patterns(model, load_recipe(None, ["model.lora.modules_to_save=[nowhere]"]).model.lora, [])
    config = lora_config(lora, ("lm_head",))
    assert config.use_rslora and config.use_dora and list(config.modules_to_save) == ["lm_head"]


def test_dora_under_zero3_and_a_trainable_adapted_weight_are_one_line_before_any_worker():
    from memtrain.config.args import parse_args
    from memtrain.train import preflight

    zero3 = ["--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json")]
    with pytest.raises(UserError, match=r"zero_optimization.stage: 3 cannot train the recipe's model.lora.use_dora: "):
        preflight.resolve_run(parse_args([*zero3, "--set", "model.lora.use_dora=true"]), 2)
    with pytest.raises(UserError, match=r"^embedded recipe 'tiny': train.trainable: model.layers.0.self_attn.q_proj."
                                        r"base_layer.weight trains beside the LoRA adapters but sits in "):
        preflight.resolve_run(parse_args([*zero3, "--set", "model.lora.target_modules=[q_proj]", "--set",
                                        "train.trainable=[model.layers.0.self_attn.q_proj.base_layer.weight]"]), 2)


def test_a_trained_tied_lm_head_goes_into_the_adapter_with_the_embedding(tmp_path):
    """Tied embeddings: lm_head.weight names the embedding too, so the adapter keeps both modules; the state that
    ZeRO-3's consolidation gives names the tensor once. Base + adapter equals the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtrain.model.freeze import freeze, saved_with_adapters
    from memtrain.model.lora import save_merged, trainable_patterns

    section = ModelSection(type="llama", config={**LLAMA, "num_hidden_layers": 1, "tie_word_embeddings": True})
    torch.manual_seed(0)
    build_model(section, build_config(section, vocab_size=100, seq_len=32)).save_pretrained(tmp_path / "base")
    pretrained = ModelSection(type="llama", pretrained=str(tmp_path / "base"), config={})
    lora = load_recipe(None, ["model.lora.target_modules=[q_proj]", "model.lora.r=2"]).model.lora

    def factory():
        return build_model(pretrained, build_config(pretrained, vocab_size=100, seq_len=32))

    trained = factory()
    add_lora(trained, lora)
    freeze(trained, trainable_patterns(trained, lora, ["lm_head.weight"]))
    with torch.no_grad():  # stands for training: every trainable tensor moves
        for p in trained.parameters():
            p.add_(0.1 * torch.randn_like(p)) if p.requires_grad else None
    state = {k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    save_merged(factory, lora, state, tmp_path / "final", saved_with_adapters(trained, lora, ["lm_head.weight"]))
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                            tmp_path / "final" / "adapter")(input_ids=ids).logits
    assert (adapted - want).abs().max().item() < 1e-4


def test_adapters_compute_in_the_base_weights_dtype_and_keep_no_fp32_copies():
    """A model built in bf16 (as ZeRO-3 builds it) gets bf16 adapters, not peft's fp32 upcast: each adapted linear layer
    would cast its input to fp32 and keep that copy for the backward (an H100 LoRA run peaked 1.28 GiB over the
    planner's bf16 profile). Independent of memtrain's profile: autograd's saved-tensor hooks count the fp32 bytes one
    forward keeps (the norms' and attention's own upcasts), and the adapters add none."""
    section = ModelSection(type="llama", config=LLAMA)
    model = build_model(section, build_config(section, vocab_size=257, seq_len=64)).to(torch.bfloat16)
    ids = torch.randint(0, 257, (2, 64))

    def fp32_kept() -> int:
        kept = {}

        def pack(t):
            if t.dtype == torch.float32 and not isinstance(t, torch.nn.Parameter):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(ids).last_hidden_state.float().sum()
        return sum(kept.values())

    model.model.embed_tokens.weight.requires_grad_(True)  # as the trainer makes the layers' input need a gradient
    plain = fp32_kept()
    add_lora(model, load_recipe(None, ["model.lora.r=4", "model.lora.target_modules=all-linear"]).model.lora)
    model.model.embed_tokens.weight.requires_grad_(True)
    adapters = {n: p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * 7 * 2 and set(adapters.values()) == {torch.bfloat16}, adapters
    assert plain > 0 and fp32_kept() == plain

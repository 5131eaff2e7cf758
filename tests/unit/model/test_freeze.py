"""train.trainable / train.frozen (memtrain.model.freeze): which parameters train, one line for a pattern that
matches nothing, and the planner counting gradients and optimizer states for the trainable ones only. Training
under ZeRO-0..3 with every policy is checked on 2 ranks in tests/launch/test_zero3_hooks.py (tests/zero3_worker.py)."""
from __future__ import annotations

import functools

import pytest
import torch

from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.memory.profile import profile_activations
from memtrain.memory.states import model_states
from memtrain.memory.target import make_target, model_and_config
from memtrain.model.build import build_config, build_model
from memtrain.model.freeze import count_trainable, freeze, trainable_names
from memtrain.train import preflight


LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}


def _model(tied: bool = False):
    section = ModelSection(type="llama", config={**LLAMA, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    return build_model(section, build_config(section, vocab_size=97, seq_len=16))


def test_patterns_select_by_name_trainable_first_then_frozen():
    model = _model()
    names = trainable_names(model, ["model.layers.*"], ["*.self_attn.*", "model.layers.1.*"])
    assert names == {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.") and "self_attn" not in n}
    assert trainable_names(model) == {n for n, _ in model.named_parameters()}  # nothing given: all train
    # a tied head is named both ways: either name selects the one parameter
    tied = _model(tied=True)
    assert "model.embed_tokens.weight" not in trainable_names(tied, frozen=["lm_head.weight"])


def test_a_pattern_that_matches_nothing_or_freezes_everything_is_one_line():
    model = _model()
    with pytest.raises(UserError, match=r"^train.frozen: 'model.embedding.\*' matches no parameter of LlamaForCausalLM "
                                        r"\(names look like model.embed_tokens.weight"):
        trainable_names(model, frozen=["model.embedding.*"])
    with pytest.raises(UserError, match=r"^train.trainable: 'mlp' matches no parameter"):
        trainable_names(model, trainable=["mlp"])  # a glob over whole names: *.mlp.* is what was meant
    with pytest.raises(UserError, match="every parameter is frozen"):
        trainable_names(model, frozen=["*"])


def test_preflight_names_the_recipe_and_the_key(capsys):
    with pytest.raises(SystemExit) as exc:
        preflight.main(["--world-size", "1", "--deepspeed", "ds_configs/zero3_ckpt.json",
                        "--set", "train.frozen=[*.attention.*]"])  # a glob list: YAML would read * as an alias
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("memtrain: error: embedded recipe 'tiny': train.frozen: "
                                                 "'*.attention.*' matches no parameter")


def test_lora_or_frozen_weights_on_a_random_base_warn_in_the_plan():
    from memtrain.config.args import parse_args

    for flags, key in ((["model.lora.r=8"], "model.lora"), (["train.frozen=[model.embed_tokens.*]"], "train.frozen")):
        warnings = preflight.resolve_run(parse_args([a for f in flags for a in ("--set", f)]), 1).warnings
        assert [w for w in warnings if "randomly initialised" in w] == [
            f"{key}: the base model is randomly initialised (no model.pretrained), so the weights that train adapt "
            "noise: this fine-tunes nothing; set model.pretrained to a local transformers directory (fine for testing "
            "the pipeline)"]
    assert not [w for w in preflight.resolve_run(parse_args([]), 1).warnings if "randomly initialised" in w]


def test_freeze_leaves_no_gradient_and_keeps_the_first_layers_gradient_with_a_frozen_embedding():
    model = _model()
    trainable, total = freeze(model, frozen=["model.embed_tokens.*"])
    assert total == sum(p.numel() for p in model.parameters())
    assert trainable == total - model.model.embed_tokens.weight.numel()
    # a reentrant checkpoint of layer 0 (DeepSpeed's, torch's use_reentrant=True) still yields its gradients
    layer0 = model.model.layers[0]
    forward = layer0.forward
    layer0.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(functools.partial(forward, **k), *a,
                                                                       use_reentrant=True)
    ids = torch.randint(0, 97, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is None
    assert all(p.grad is not None for p in layer0.parameters())


def test_planner_counts_gradients_and_adam_states_of_trainable_parameters_only():
    recipe = load_recipe(None, ["train.frozen=[model.embed_tokens.*,*.self_attn.*]"])
    target = make_target(recipe, {"zero_optimization": {"stage": 3}}, 1, "cpu")
    model = build_model(recipe.model, model_and_config(recipe))
    assert (target.trainable_params, target.all_params) == (
        count_trainable(model, frozen=recipe.train.frozen), sum(p.numel() for p in model.parameters()))
    full_target = make_target(load_recipe(None), {"zero_optimization": {"stage": 3}}, 1, "cpu")
    profile = profile_activations(model_and_config(recipe), full_target, ("keep",))
    ds = {"zero_optimization": {"stage": 3}}
    frozen, full = model_states(profile, ds, target), model_states(profile, ds, full_target)
    ratio = target.trainable_params / target.all_params
    assert frozen.params == full.params
    assert frozen.grads == pytest.approx(full.grads * ratio, abs=4) and frozen.optimizer == pytest.approx(
        full.optimizer * ratio, abs=16)

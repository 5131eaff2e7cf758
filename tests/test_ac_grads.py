"""Every AC policy gives the same gradients as no recompute (in-process, torch backend)."""
import copy

import pytest
import torch

from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import plan_for, parse_policy
from memtrain.errors import UserError
from memtrain.memory.tracker import ActivationMeter
from memtrain.model.build import build_config, build_model, decoder_layers
from memtrain.config.recipe import ModelSection

FAMILIES = {
    "llama": {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
POLICIES = ["full", "every:2", "first:1", "first:9"]


def _model(family):
    section = ModelSection(type=family, config=FAMILIES[family])
    config = build_config(section, vocab_size=257, seq_len=32)
    torch.manual_seed(0)
    return build_model(section, config).train()


def _grads_and_activation(model, policy, ids):
    _, layers = decoder_layers(model)
    apply_plan(layers, plan_for(policy, len(layers), backend="torch"))
    meter = ActivationMeter()
    with meter.measure():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, meter.bytes


@pytest.mark.parametrize("family", FAMILIES)
def test_policies_match_no_recompute(family):
    base = _model(family)
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    ref, ref_bytes = _grads_and_activation(copy.deepcopy(base), "none", ids)
    for policy in POLICIES:
        grads, act_bytes = _grads_and_activation(copy.deepcopy(base), policy, ids)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")
        assert act_bytes < ref_bytes, f"{policy} keeps {act_bytes} bytes, none keeps {ref_bytes}"


def test_policy_parsing():
    assert parse_policy("every:2", 5) == ("full", "keep", "full", "keep", "full")
    assert parse_policy("first:2", 3) == ("full", "full", "keep")
    assert parse_policy("none", 2) == ("keep", "keep")
    for bad in ["every:0", "every:x", "every", "first:-1", "sometimes"]:
        with pytest.raises(UserError, match="activation_checkpointing.policy"):
            parse_policy(bad, 4)

import pytest

from memtrain.errors import UserError
from memtrain.model import build_config, build_model, matmul_params
from memtrain.recipe import ModelSection


def _build(type_, config):
    section = ModelSection(type=type_, config=config)
    return build_model(section, build_config(section, vocab_size=257, seq_len=32))


def test_matmul_params_skip_lookups_but_count_the_head():
    llama = _build("llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "max_position_embeddings": 64})
    total = sum(p.numel() for p in llama.parameters())
    assert matmul_params(llama) == total - 257 * 32  # untied: input embedding is a lookup only
    gpt2 = _build("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64})
    total = sum(p.numel() for p in gpt2.parameters())  # tied wte counted once here
    assert matmul_params(gpt2) == total - 64 * 32  # wpe is a lookup; tied wte still runs as the head


@pytest.mark.parametrize("type_, config, seq_len, message", [
    ("lama", {}, 32, "model.type: unknown transformers model type 'lama'; did you mean 'llama'?"),
    ("llama", {"hidden_sise": 32}, 32, "model.config.hidden_sise: not a llama config key; did you mean 'hidden_size'?"),
    ("llama", {"hidden_size": 30, "num_attention_heads": 4}, 32, "model.config.num_attention_heads: 4 heads do not divide hidden_size 30"),
    ("llama", {"max_position_embeddings": 16}, 32, "data.seq_len: 32 exceeds the model's max_position_embeddings 16"),
])
def test_model_config_mistakes(type_, config, seq_len, message):
    with pytest.raises(UserError) as e:
        build_config(ModelSection(type=type_, config=config), vocab_size=257, seq_len=seq_len)
    assert str(e.value) == message

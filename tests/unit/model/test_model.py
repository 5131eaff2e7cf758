import pytest

from memtrain.errors import UserError
from memtrain.model.build import build_config
from memtrain.config.recipe import ModelSection


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

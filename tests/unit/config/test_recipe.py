import re

import pytest

from memtrain.errors import UserError
from memtrain.config.recipe import load_recipe


def test_default_recipe_and_overrides():
    r = load_recipe(None, ["activation_checkpointing.policy=every:2", "train.micro_batch_size=4", "train.lr=1e-3"])
    assert r.name == "tiny"
    assert r.activation_checkpointing.policy == "every:2"
    assert r.train.micro_batch_size == 4 and r.train.lr == 1e-3


@pytest.mark.parametrize("override, expected", [
    ("train.micro_batchsize=4", "unknown key 'train.micro_batchsize'; did you mean 'micro_batch_size'?"),
    ("train.micro_batch_size=0", "train.micro_batch_size: Input should be greater than 0"),
    ("train.max_steps=many", "train.max_steps: Input should be a valid integer"),
    ("trian.lr=1", "unknown key 'trian'; did you mean 'train'?"),
    # a Union key names itself and every alternative, not pydantic's member tag ('train.compile.bool')
    ("train.compile=maybe", "train.compile: expected a valid boolean or 'auto' (got 'maybe')"),
    ("activation_checkpointing.tiled_mlp=x", "activation_checkpointing.tiled_mlp: expected 'auto' or a valid integer "
                                             "(got 'x')"),
])
def test_bad_override_names_the_key(override, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        load_recipe(None, [override])

import re

import pytest

from conftest import run_train
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


def test_bad_recipe_key_is_one_line_without_traceback(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  type: llama\ntrain:\n  micro_batch_sise: 4\n")
    proc = run_train(["--recipe", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "bad.yaml: unknown key 'train.micro_batch_sise'; did you mean 'micro_batch_size'?" in lines[0]
    assert not (tmp_path / "run").exists()


def test_error_found_after_deepspeed_import_is_still_one_line(tmp_path):
    """Policy checks run after DeepSpeed is imported; its accelerator auto-detection must not add a line."""
    proc = run_train(["--set", "activation_checkpointing.policy=every:x", "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "activation_checkpointing.policy: 'every:x': expected a positive integer" in lines[0]

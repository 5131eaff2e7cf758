

from conftest import run_train


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

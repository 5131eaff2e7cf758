"""Every bad input is one stderr line naming the file and key path, exit 2, before any worker starts.

Most cases call the preflight check in-process (`memtrain.train.preflight.main`, the same `check_run`
the trainer calls in every worker); two go through real subprocesses to show there is exactly
one line and no traceback, and that no run directory appears.
"""
import json
import subprocess
import sys

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import ROOT, _env, run_train
from memtrain.train import preflight as validate
from memtrain.config.args import parse_args

DS = ROOT / "ds_configs" / "zero3_ckpt.json"


def _ds(tmp_path, edit, name="ds.json"):
    """A copy of the default DeepSpeed JSON with `edit(cfg)` applied."""
    cfg = json.loads(DS.read_text())
    edit(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _error(capsys, argv, world=2):
    """Run the preflight in-process; return its single stderr line (asserting exit 2)."""
    with pytest.raises(SystemExit) as exc:
        validate.main(["--world-size", str(world), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("memtrain: error: ")
    return err[0]


def _set(*pairs):
    return [a for p in pairs for a in ("--set", p)]


@pytest.mark.parametrize("argv, expected", [
    # unknown keys, with a suggestion
    (_set("train.micro_batchsize=4"), "unknown key 'train.micro_batchsize'; did you mean 'micro_batch_size'?"),
    # wrong types, zero or negative sizes
    (_set("train.max_steps=many"), "train.max_steps: Input should be a valid integer"),
    (_set("train.micro_batch_size=0"), "train.micro_batch_size: Input should be greater than 0"),
    (_set("data.seq_len=-8"), "data.seq_len: Input should be greater than 0"),
    # AC policy names
    (_set("activation_checkpointing.policy=sometimes"),
     "embedded recipe 'tiny': activation_checkpointing.policy: 'sometimes'"),
    (_set("activation_checkpointing.policy=every:x"), "activation_checkpointing.policy: 'every:x'"),
    (_set("activation_checkpointing.policy=every:0"), "activation_checkpointing.policy: 'every:0'"),
    # model shape vs data
    (_set("data.seq_len=512"), "data.seq_len: 512 exceeds the model's max_position_embeddings 256"),
    (_set("model.config.num_attention_heads=3"),
     "model.config.num_attention_heads: 3 heads do not divide hidden_size 128"),
    # data paths
    (_set("data.paths=[/nonexistent/corpus/*.txt]"), "data.paths[0]: '/nonexistent/corpus/*.txt' matches no file"),
    # missing files
    (["--deepspeed", "no/such.json"], "no/such.json: DeepSpeed config not found"),
    (["--recipe", "no/such.yaml"], "no/such.yaml: recipe file not found"),
    # (train.warmup_steps=0 is legal: "auto" warm-up fills at least 1, as transformers does; test_ds_corpus.py)
])
def test_bad_recipe_or_override(capsys, argv, expected):
    assert expected in _error(capsys, argv)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.update(trian_batch_size=16), "unknown key 'trian_batch_size'; did you mean 'train_batch_size'?"),
    (lambda c: c["zero_optimization"].update(stage3_max_live_parameter=1),
     "unknown key 'zero_optimization.stage3_max_live_parameter'; did you mean 'stage3_max_live_parameters'?"),
    (lambda c: c["activation_checkpointing"].update(partition_activation=True),
     "unknown key 'activation_checkpointing.partition_activation'; did you mean 'partition_activations'?"),
    (lambda c: c["tensorboard"].update(enabeld=True), "unknown key 'tensorboard.enabeld'; did you mean 'enabled'?"),
    (lambda c: c.update(train_micro_batch_size_per_gpu="four"),
     "train_micro_batch_size_per_gpu: expected a positive integer or \"auto\", got \"four\""),
    (lambda c: c["optimizer"]["params"].update(lr=-1), "optimizer.params.lr: expected a positive number"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "gpu"}),
     "zero_optimization.offload_param.device: Input should be 'none', 'cpu' or 'nvme'"),
    (lambda c: c["zero_optimization"].update(stage=4), "zero_optimization.stage: 4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
    (lambda c: c["zero_optimization"].update(stage=-1), "zero_optimization.stage: -1 is not a ZeRO stage"),
    (lambda c: c["zero_optimization"].update(stage="three"), "zero_optimization.stage: \"three\" is not a ZeRO stage"),
    (lambda c: c["activation_checkpointing"].update(contiguous_memory_optimization=True),
     "activation_checkpointing.contiguous_memory_optimization: needs partition_activations: true"),
    (lambda c: c["activation_checkpointing"].update(contiguous_memory_optimization=True, partition_activations=True,
                                                    number_checkpoints=None),
     "activation_checkpointing.contiguous_memory_optimization: needs number_checkpoints"),
    # batch sizes: micro x accumulation x world size (2 here)
    (lambda c: c.update(train_batch_size=32), "train_batch_size: 32 != micro batch 8 x grad accum 1 x world size 2 = 16"),
    (lambda c: c.update(gradient_accumulation_steps=4),
     "gradient_accumulation_steps: 4 disagrees with the recipe's train.grad_accum_steps=1"),
    (lambda c: c["optimizer"].update(type="AdamX"), "optimizer.type: unknown optimizer \"AdamX\"; did you mean 'adam'?"),
    (lambda c: c.update(fp16={"enabled": True}, bf16={"enabled": True}),
     "DeepSpeed rejects it: bfloat16 and fp16 modes cannot be simultaneously enabled"),
])
def test_bad_deepspeed_json(capsys, tmp_path, edit, expected):
    path = _ds(tmp_path, edit)
    assert f"{path}: {expected}" in _error(capsys, ["--deepspeed", path])


def test_malformed_files(capsys, tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"train_batch_size": "auto",}')
    assert f"{bad_json}: malformed JSON at line 1 column 29" in _error(capsys, ["--deepspeed", str(bad_json)])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  lr: [1e-3\n")
    assert f"{bad_yaml}: malformed YAML at line" in _error(capsys, ["--recipe", str(bad_yaml)])


def test_data_without_usable_text(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n\t\n")
    line = _error(capsys, _set(f"data.paths=[{tmp_path}/*.txt]"))
    assert f"data.paths: {tmp_path}/*.txt: the 2 matched file(s) hold no text" in line
    (tmp_path / "short.txt").write_text("too short for one sequence")  # caught when packing
    line = _error(capsys, _set(f"data.paths=[{tmp_path}/*.txt]", f"data.cache_dir={tmp_path}/cache"))
    assert "data.paths: 3 file(s) hold 27 tokens, fewer than one sequence of data.seq_len=128" in line


def test_op_policy_with_reentrant_backend(capsys, tmp_path):
    path = _ds(tmp_path, lambda c: c["activation_checkpointing"].update(partition_activations=True))
    line = _error(capsys, ["--deepspeed", path, *_set("activation_checkpointing.policy=op")])
    assert "activation_checkpointing.policy: 'op'" in line and "reentrant" in line
    line = _error(capsys, _set("activation_checkpointing.policy=op", "activation_checkpointing.backend=deepspeed"))
    assert "activation_checkpointing.policy: 'op'" in line and "activation_checkpointing.backend" in line


def test_run_directory_rules(capsys, tmp_path):
    run = tmp_path / "run"
    assert f"--resume: no complete model checkpoint in {run / 'checkpoints'}" in _error(
        capsys, ["--run-dir", str(run), "--resume"])
    (run / "checkpoints" / ".tmp-step00000004").mkdir(parents=True)  # a save that was killed is no checkpoint
    assert "--resume: no complete model checkpoint" in _error(capsys, ["--run-dir", str(run), "--resume"])
    (run / "config.json").write_text(json.dumps({"world_size": 1}))
    assert f"--run-dir {run}: already holds a run; pass --resume" in _error(capsys, ["--run-dir", str(run)])
    assert "--overwrite: cannot be combined with --resume" in _error(
        capsys, ["--run-dir", str(run), "--resume", "--overwrite"])
    (run / "checkpoints" / "step00000002").mkdir()
    assert f"--resume: {run} was trained with world size 1, this launch has 2" in _error(
        capsys, ["--run-dir", str(run), "--resume"])


def test_legal_but_useless_settings_warn(tmp_path):
    path = _ds(tmp_path, lambda c: (c["activation_checkpointing"].update(partition_activations=True),
                                    c.update(my_note="hi"), c["optimizer"]["params"].update(lr=1e-3)))
    checked = validate.check_run(parse_args(["--deepspeed", path]), 2)
    assert any("partition_activations" in w and "shards nothing" in w for w in checked.plan.warnings)
    assert f"{path}: 'my_note' is not a DeepSpeed config key; DeepSpeed ignores it" in checked.warnings
    assert f"{path}: optimizer.params.lr=0.001 overrides the recipe's train.lr=0.003" in checked.warnings


def test_one_line_no_traceback_no_worker(tmp_path):
    """Through real processes: the preflight `make train` runs, and the trainer itself."""
    path = _ds(tmp_path, lambda c: c["zero_optimization"].update(stage=5))
    pre = subprocess.run([sys.executable, "-m", "memtrain.train.preflight", "--world-size", "2", "--deepspeed", path],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert pre.returncode == 2
    assert pre.stderr.strip().splitlines() == [
        f"memtrain: error: {path}: zero_optimization.stage: 5 is not a ZeRO stage; allowed: 0, 1, 2, 3"]
    run = tmp_path / "run"
    proc = run_train(["--deepspeed", path, "--run-dir", str(run)], timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == pre.stderr.strip().splitlines()
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run.exists()

"""Every bad input is one stderr line naming the file and key path, exit 2, before any worker starts.

Most cases call the preflight check in-process (`memtrain.train.preflight.main`, the same `resolve_run`
the trainer calls in every worker); two go through real subprocesses to show there is exactly
one line and no traceback, and that no run directory appears.
"""
import json

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import ROOT
from families import overrides
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
    (_set("train.min_lr=0.01"), "train.min_lr: Value error, the schedule's floor must not exceed train.lr=0.003"),
    (_set("data.seq_len=-8"), "data.seq_len: Input should be greater than 0"),
    # values no run survives: not finite, or an update that overflows float32
    (_set("train.lr=.inf"), "train.lr: Input should be a finite number"),
    (_set("train.grad_clip=nan"), "train.grad_clip: Input should be a finite number"),
    (_set("train.lr=1e39"), "train.lr: Value error, 1e+39 would overflow float32 in the optimizer's update"),
    # AC policy names
    (_set("activation_checkpointing.policy=sometimes"),  # the recipe's validator: named as every recipe key is
     "recipe 'tiny' (embedded default) with --set: activation_checkpointing.policy: 'sometimes': unknown policy"),
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
     "zero_optimization.offload_param.device: expected none, cpu or nvme or \"auto\", got \"gpu\""),
    (lambda c: c["zero_optimization"].update(stage=4), "zero_optimization.stage: 4 is not a ZeRO stage; allowed: 0, 1, 2, 3"),
    (lambda c: c["zero_optimization"].update(stage=-1), "zero_optimization.stage: -1 is not a ZeRO stage"),
    (lambda c: c["zero_optimization"].update(stage="three"), "zero_optimization.stage: \"three\" is not a ZeRO stage"),
    (lambda c: c["activation_checkpointing"].update(contiguous_memory_optimization=True, partition_activations=False),
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
    # DeepSpeed divides by these mid-run: a ZeroDivisionError in every worker
    (lambda c: c.update(steps_per_print=0), "steps_per_print: expected a positive integer (DeepSpeed divides by it), got 0"),
    (lambda c: c.update(steps_per_print=2.5), "steps_per_print: expected a positive integer"),
    (lambda c: c.update(gradient_predivide_factor=0), "gradient_predivide_factor: expected a positive number"),
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
    # no TP group and a CPU run: neither key takes effect, so 'auto' keeps torch's checkpoint and op-level runs
    checked = validate.resolve_run(parse_args(["--deepspeed", path, *_set("activation_checkpointing.policy=op")]), 2)
    assert checked.plan.backend == "torch" and set(checked.plan.layers) == {"op"}
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
    (run / "checkpoints" / "step00000002").mkdir()  # an empty step directory is a damaged checkpoint
    assert (f"--resume: no intact model checkpoint in {run / 'checkpoints'}; the newest, "
            f"{run / 'checkpoints' / 'step00000002'}, is damaged: no model states file (the directory holds no "
            "checkpoint file)") in _error(capsys, ["--run-dir", str(run), "--resume"])
    # world size, shapes, finished runs and damaged files with real checkpoints: tests/launch/test_run_dir_safety.py


def test_legal_but_useless_settings_warn(tmp_path):
    path = _ds(tmp_path, lambda c: (c["activation_checkpointing"].update(partition_activations=True),
                                    c.update(my_note="hi"), c["optimizer"]["params"].update(lr=1e-3)))
    checked = validate.resolve_run(parse_args(["--deepspeed", path]), 2)
    # no tensor-parallel group and a CPU run: both keys are no-ops, each with its one plan line
    assert checked.plan.notes == (
        "partition_activations: nothing to shard: no tensor-parallel group (tensor_parallel.autotp_size is 1) "
        "to split checkpointed inputs across",
        "cpu_checkpointing: a CPU run's activations are already in host memory: no copies, no cost")
    assert not checked.plan.partition_activations and not checked.plan.cpu_checkpointing
    assert checked.plan.backend == "torch" and not any(checked.plan.offload)  # nothing left for DeepSpeed's checkpoint
    assert all(line in checked.plan.describe() for line in checked.plan.notes)
    assert f"{path}: 'my_note' is not a DeepSpeed config key; DeepSpeed ignores it" in checked.warnings
    assert f"{path}: optimizer.params.lr=0.001 overrides the recipe's train.lr=0.003" in checked.warnings


# --------------------------------------------------------------------------- round two (issue 18)

def _files(tmp_path):
    """Data, recipe and JSON files that are not what their names say."""
    d = tmp_path
    (d / "binary.txt").write_bytes(b"PK\x03\x04\0\0text")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    (d / "body.jsonl").write_text('{"body": "no text column", "id": 1}\n')
    (d / "list.jsonl").write_text('["a", "b"]\n')
    (d / "chat.jsonl").write_text('this is not json\n{"messages": []}\n')
    (d / "chat-keys.jsonl").write_text('{"conversations": []}\n')
    (d / "fake.parquet").write_text("a text file named .parquet\n" * 10)
    (d / "a-file").write_text("")
    (d / "held-out.txt").write_text("held-out text, long enough to fill a few rows of 128 byte tokens. " * 20)
    (d / "short.txt").write_text("one row and a half of held-out text: " * 5)
    (d / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    for name, text in (("broken", '{"model_type": "llama", "hidden_size": 128'), ("untyped", '{"hidden_size": 128}'),
                       ("unknown", '{"model_type": "lama"}')):
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
    return d


@pytest.mark.parametrize("argv, expected", [
    (["--max-steps", "abc"], "--max-steps: invalid int value: 'abc' (see python -m memtrain preflight --help)"),
    (["--max-steps"], "--max-steps: expected one argument (see python -m memtrain preflight --help)"),
    (["--world-size", "two"], "--world-size: invalid int value: 'two' (see python -m memtrain preflight --help)"),
    (["--run-dir", ""], "--run-dir: empty path (see python -m memtrain preflight --help)"),
    (["--steps", "5"], "unrecognized arguments: --steps 5 (see python -m memtrain preflight --help)"),
    (_set("data.seq_len=1"), "embedded recipe 'tiny': data.seq_len: 1 leaves no next token to predict (the labels "
     "are the inputs shifted by one); expected 2 or more"),
    (_set("data.paths=[{d}/binary.txt]"), "embedded recipe 'tiny': data.paths: {d}/binary.txt: binary data (a NUL "
     "byte at offset 4); expected text (.txt files are read as text)"),
    (_set("data.paths=[{d}/latin1.txt]"), "embedded recipe 'tiny': data.paths: {d}/latin1.txt: not UTF-8 text "
     "(byte 0xe9 at offset 3)"),
    (_set("data.paths=[{d}/bad.jsonl]"), "embedded recipe 'tiny': data.paths: {d}/bad.jsonl: line 2: malformed JSON "
     "(Unterminated string starting at at column 10); expected one JSON object per line"),
    (_set("data.paths=[{d}/body.jsonl]"), "embedded recipe 'tiny': data.text_key: 'text' is not a field of "
     "{d}/body.jsonl (line 1 has: body, id)"),
    (_set("data.paths=[{d}/list.jsonl]"), "embedded recipe 'tiny': data.paths: {d}/list.jsonl: line 1: a JSON list, "
     "expected an object with a 'text' field"),
    (_set("data.paths=[{d}/fake.parquet]"), "embedded recipe 'tiny': data.paths: {d}/fake.parquet: not a parquet file "
     "(Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.)"),
    (_set("data.format=chat", f"data.tokenizer={ROOT / 'data' / 'chat' / 'tokenizer'}", "data.paths=[{d}/chat.jsonl]"),
     "embedded recipe 'tiny': data.paths: {d}/chat.jsonl: line 1: malformed JSON (Expecting value at column 1); "
     "expected one JSON object per line"),
    (_set("data.format=chat", f"data.tokenizer={ROOT / 'data' / 'chat' / 'tokenizer'}",
          "data.paths=[{d}/chat-keys.jsonl]"),
     "embedded recipe 'tiny': data.messages_key: 'messages' is not a field of {d}/chat-keys.jsonl (line 1 has: "
     "conversations)"),
    (_set("data.format=chat", f"data.tokenizer={ROOT / 'data' / 'chat' / 'tokenizer'}", *overrides("opt")),
     "embedded recipe 'tiny': data.format: 'chat' packs whole samples into rows with positions restarting per sample, "
     "and OPTForCausalLM (opt) does not keep them apart: its attention mask ignores the position ids"),
    # held-out evaluation
    (_set("train.eval_every=5"), "embedded recipe 'tiny': train.eval_every: set, but there is no held-out data to "
     "evaluate; name it with data.eval_paths"),
    (_set("train.eval_batches=2"), "embedded recipe 'tiny': train.eval_batches: set, but there is no held-out data"),
    (_set("data.eval_paths=[/nonexistent/held-out/*.txt]"), "embedded recipe 'tiny': data.eval_paths[0]: "
     "'/nonexistent/held-out/*.txt' matches no file"),
    (_set("data.eval_paths=[{d}/latin1.txt]"), "embedded recipe 'tiny': data.eval_paths: {d}/latin1.txt: not UTF-8 "
     "text (byte 0xe9 at offset 3)"),
    (_set("data.paths=[{d}/held-out.txt]", "data.eval_paths=[{d}/held-out.txt]"), "embedded recipe 'tiny': "
     "data.eval_paths: {d}/held-out.txt is in data.paths too (1 file(s) in both): held-out data must not be "
     "trained on"),
    (_set("data.eval_paths=[{d}/held-out.txt]", "data.random_tokens=true"), "embedded recipe 'tiny': "
     "data.eval_paths: data.random_tokens trains on random ids"),
    (_set("data.eval_paths=[{d}/held-out.txt]", "data.eval_fraction=0.1"), "embedded recipe 'tiny': "
     "data.eval_paths and data.eval_fraction: both set"),
    (_set("data.format=chat", f"data.tokenizer={ROOT / 'data' / 'chat' / 'tokenizer'}", "data.eval_fraction=0.1"),
     "embedded recipe 'tiny': data.eval_fraction: splits text documents; data.format 'chat' rows are held out by "
     "naming their files in data.eval_paths"),
    (_set("data.eval_paths=[{d}/short.txt]", "data.cache_dir={d}/cache"), "data.eval_paths: the eval data packs "
     "into 1 row(s), fewer than one eval batch (2 data rank(s) x micro-batch 8); add held-out text"),
    (_set("data.cache_dir={d}/a-file/cache"), "embedded recipe 'tiny': data.cache_dir: '{d}/a-file/cache' cannot be "
     "created: '{d}/a-file' is a file, not a directory"),
    (_set("data.cache_dir={d}/a-file"), "embedded recipe 'tiny': data.cache_dir: '{d}/a-file' exists and is not a "
     "directory"),
    (["--run-dir", "{d}/a-file/run"], "--run-dir: '{d}/a-file/run' cannot be created: '{d}/a-file' is a file, "
     "not a directory"),
    (["--run-dir", "{d}/a-file"], "--run-dir: '{d}/a-file' exists and is not a directory"),
    (["--recipe", "{d}/latin1.yaml"], "{d}/latin1.yaml: not UTF-8 text (byte 0xe9 at offset 9); save the recipe as "
     "UTF-8"),
    (_set("model.config.hidden_act=gelux"), "embedded recipe 'tiny': model.config.hidden_act: transformers cannot "
     "build llama with it: 'gelux' is not a name it knows; did you mean 'gelu'?"),
    (_set("model.config.intermediate_size=-4"), "embedded recipe 'tiny': model.config.intermediate_size: transformers "
     "cannot build llama with it: Trying to create tensor with negative dimension -4: [-4, 128]"),
    (["--recipe", str(ROOT / "recipes" / "gpt2-small.yaml"), *_set("model.config.activation_function=relu6x")],
     f"{ROOT / 'recipes' / 'gpt2-small.yaml'}: model.config.activation_function: transformers cannot build gpt2 with it: 'relu6x' is "
     "not a name it knows; did you mean 'relu6'?"),
    (_set("model.config.rms_norm_eps=abc"), "embedded recipe 'tiny': model.config.rms_norm_eps: TypeError: Field "
     "'rms_norm_eps' expected float, got str (value: 'abc')"),
    (_set("model.config.attention_dropout=2"), "embedded recipe 'tiny': model.config.attention_dropout: 2 is not a "
     "dropout probability; expected a number in [0, 1]"),
    (_set("model.pretrained={d}/broken"), "embedded recipe 'tiny': model.pretrained: {d}/broken/config.json: "
     "malformed JSON at line 1 column 43: Expecting ',' delimiter"),
    (_set("model.pretrained={d}/untyped"), "embedded recipe 'tiny': model.pretrained: {d}/untyped/config.json: no "
     "'model_type' key (expected a transformers model type, e.g. \"llama\")"),
    (_set("model.pretrained={d}/unknown"), "embedded recipe 'tiny': model.pretrained: {d}/unknown/config.json: "
     "model_type: unknown transformers model type 'lama'; did you mean 'llama'?"),
    (_set("activation_checkpointing.policy=modules", "activation_checkpointing.modules=[model.layers.*.mpl]"),
     "embedded recipe 'tiny': activation_checkpointing.modules: 'model.layers.*.mpl' matches no module of "
     "LlamaForCausalLM ('*' is one path part; e.g. model.layers.0.self_attn, model.layers.0.mlp, "
     "model.layers.0.input_layernorm, model.layers.0.post_attention_layernorm)"),
    (_set("activation_checkpointing.policy=modules", "activation_checkpointing.modules=[layers.*.mlp]"),
     "embedded recipe 'tiny': activation_checkpointing.modules: 'layers.*.mlp' matches no module of LlamaForCausalLM"),
])
def test_round_two_mistakes(capsys, tmp_path, argv, expected):
    d = _files(tmp_path)
    argv = [a.replace("{d}", str(d)) for a in argv]
    line = _error(capsys, argv)
    assert line.startswith(f"memtrain: error: {expected.replace('{d}', str(d))}"), line


def test_non_utf8_deepspeed_json(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(DS.read_bytes().replace(b'"auto"', b'"\xe0uto"', 1))
    offset = path.read_bytes().index(b"\xe0")
    assert _error(capsys, ["--deepspeed", str(path)]) == (
        f"memtrain: error: {path}: not UTF-8 text (byte 0xe0 at offset {offset}); a DeepSpeed config is JSON, "
        "which is UTF-8")


@pytest.mark.parametrize("module, argv, expected", [
    ("plan", ["--budget=-1GB"], "--budget: '-1GB' must be a positive memory size (e.g. 40GiB)"),
    ("plan", ["--budget"], "--budget: expected one argument (see python -m memtrain plan --help)"),
    ("plan", ["--ngpus", "x"], "--ngpus: invalid int value: 'x' (see python -m memtrain plan --help)"),
    ("report", ["--budget=-1GB"], "BUDGET: '-1GB' must be a positive memory size (e.g. 40GiB)"),
    ("report", ["--budget"], "--budget: expected one argument (see python -m memtrain report --help)"),
])
def test_tool_flags_one_line(capsys, module, argv, expected):
    """`make plan BUDGET=-1GB` runs `python -m memtrain.tools.plan --budget=-1GB` (and report likewise)."""
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"memtrain.tools.{module}").main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"memtrain: error: {expected}"]

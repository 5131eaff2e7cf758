"""model.pretrained inputs (memtrain.model.pretrained, the data.tokenizer default): each mistake one line from the
preflight, before any worker starts and with nothing written; the pretrained directory's own tokenizer used when
data.tokenizer is unset. A tiny Llama saved with save_pretrained beside a small byte-level BPE tokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import FAST, ROOT
from memtrain.config.args import parse_args
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.model.build import build_config, build_model
from memtrain.train.preflight import resolve_run


LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
VOCAB = 300  # the tokenizer's size; the model's embeddings have VOCAB rows


def _tokenizer(vocab: int):
    """A byte-level BPE of `vocab` ids trained here (what a pretrained directory ships)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (ROOT / "src" / "memtrain" / "train" / "preflight.py").read_text()
    tok.train_from_iterator([text] * 4, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A saved tiny Llama (model.safetensors + config.json) and its own tokenizer of VOCAB ids."""
    d = tmp_path_factory.mktemp("pretrained") / "llama"
    section = ModelSection(type="llama", config=LLAMA)
    torch.manual_seed(0)
    build_model(section, build_config(section, vocab_size=VOCAB, seq_len=64)).save_pretrained(d)
    _tokenizer(VOCAB).save_pretrained(d)
    return d


def _copy(pretrained, tmp_path, name="model"):
    d = tmp_path / name
    shutil.copytree(pretrained, d)
    return d


def _check(tmp_path, *sets):
    """The preflight as every entry point runs it, in this process; the run directory it would use."""
    run = tmp_path / "run"
    argv = [*FAST, "--run-dir", str(run)] + [a for s in sets for a in ("--set", s)]
    return resolve_run(parse_args(argv), 1), run


def _error(tmp_path, *sets) -> str:
    with pytest.raises(UserError) as e:
        _check(tmp_path, *sets)
    assert not (tmp_path / "run").exists()  # nothing written
    line = str(e.value)
    assert "\n" not in line
    return line


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_truncated_safetensors_is_one_line(pretrained, tmp_path):
    d = _copy(pretrained, tmp_path)
    weights = d / "model.safetensors"
    size = weights.stat().st_size
    _truncate(weights, size - 100)  # the header intact, the last tensor cut short
    line = _error(tmp_path, f"model.pretrained={d}", "model.config={}")
    assert line == (f"embedded recipe 'tiny': model.pretrained: {weights}: truncated or not a safetensors "
                    f"file: its header declares {size:,} bytes, the file holds {size - 100:,}")
    _truncate(weights, 4)  # safetensors' own "invalid header length"
    assert "shorter than the 8-byte header length" in _error(tmp_path, f"model.pretrained={d}", "model.config={}")


def _shard(pretrained, tmp_path):
    """The same checkpoint as two shards and an index (as save_pretrained writes a large model)."""
    from safetensors.torch import load_file, save_file

    d = _copy(pretrained, tmp_path, "sharded")
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, d / file, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    return d


def test_sharded_checkpoint_missing_or_truncated_shard(pretrained, tmp_path):
    d = _shard(pretrained, tmp_path)
    _check(tmp_path, f"model.pretrained={d}", "model.config={}")  # whole: passes
    second = d / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    _truncate(second, len(data) // 2)
    line = _error(tmp_path, f"model.pretrained={d}", "model.config={}")
    assert line.startswith(f"embedded recipe 'tiny': model.pretrained: {second}: truncated or not a "
                           "safetensors file")
    second.unlink()
    assert _error(tmp_path, f"model.pretrained={d}", "model.config={}").endswith(
        f"model.pretrained: {d / 'model.safetensors.index.json'}: names shard model-00002-of-00002.safetensors, "
        f"which is not in {d}")


def test_pytorch_model_bin_truncated(pretrained, tmp_path):
    from safetensors.torch import load_file

    d = _copy(pretrained, tmp_path, "bin")
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    _check(tmp_path, f"model.pretrained={d}", "model.config={}")  # whole: passes (shapes read from the zip)
    bin_file = d / "pytorch_model.bin"
    _truncate(bin_file, bin_file.stat().st_size - 10)
    assert _error(tmp_path, f"model.pretrained={d}", "model.config={}").startswith(
        f"embedded recipe 'tiny': model.pretrained: {bin_file}: truncated or not a torch checkpoint")


def test_config_without_weights(pretrained, tmp_path):
    d = _copy(pretrained, tmp_path)
    (d / "model.safetensors").unlink()
    assert _error(tmp_path, f"model.pretrained={d}", "model.config={}") == (
        f"embedded recipe 'tiny': model.pretrained: {d} holds config.json but no weight file "
        "(model.safetensors, model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json); "
        "copy the checkpoint's weights there, or leave model.pretrained unset to train from config")


def test_model_config_override_that_disagrees_with_the_checkpoint(pretrained, tmp_path):
    # the tiny recipe's model.config left in place (the LoRA recipe without --set model.config={})
    line = _error(tmp_path, f"model.pretrained={pretrained}", "model.lora.r=4")
    assert line.startswith("embedded recipe 'tiny': model.config: hidden_size 128 (config.json: 32), "
                           "intermediate_size 352 (config.json: 64), num_hidden_layers 4 (config.json: 2)")
    assert ("disagrees with model.pretrained: model.embed_tokens.weight is [300, 128] in the configured model, "
            f"[300, 32] in {pretrained / 'model.safetensors'}; drop it (--set model.config={{}}) to train the "
            "checkpoint as saved") in line
    assert "max_position_embeddings" not in line.split(":")[2]  # 128 in both: not a disagreement
    # same shapes, more layers: transformers would start layers 2 and 3 random
    line = _error(tmp_path, f"model.pretrained={pretrained}", "model.config={num_hidden_layers: 4}")
    assert line.endswith("model.config: num_hidden_layers 4 (config.json: 2) disagrees with model.pretrained: the "
                         "configured model has model.layers.2.self_attn.q_proj.weight, which the checkpoint's config "
                         "gives no weight; drop it (--set model.config={}) to train the checkpoint as saved")
    # an override that changes no parameter (attention dropout) stays legal
    _check(tmp_path, f"model.pretrained={pretrained}", "model.config={attention_dropout: 0.1}")


def test_override_that_resizes_fused_experts(tmp_path):
    """Mixtral's experts are stored one tensor each and built as one fused tensor (transformers converts on load):
    the override is compared with the model the checkpoint's own config builds."""
    d = tmp_path / "mixtral"
    section = ModelSection(type="mixtral", config={**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2})
    build_model(section, build_config(section, vocab_size=VOCAB, seq_len=64)).save_pretrained(d)
    _check(tmp_path, f"model.pretrained={d}", "model.config={}")
    assert _error(tmp_path, f"model.pretrained={d}", "model.config={intermediate_size: 96}") == (
        "embedded recipe 'tiny': model.config: intermediate_size 96 (config.json: 64) disagrees with model.pretrained: "
        "model.layers.0.mlp.experts.gate_up_proj is [4, 192, 32] in the configured model, [4, 128, 32] in the "
        "checkpoint's; drop it (--set model.config={}) to train the checkpoint as saved")


def test_pretrained_tokenizer_is_the_default(pretrained, tmp_path):
    checked, _ = _check(tmp_path, f"model.pretrained={pretrained}", "model.config={}")
    assert checked.tokenizer.name == str(pretrained.resolve()) and checked.tokenizer.vocab_size == VOCAB
    assert not [w for w in checked.warnings if "data.tokenizer" in w]
    recipe = load_recipe(None, [f"model.pretrained={pretrained}"])
    assert recipe.data.tokenizer == str(pretrained)  # what config.json records, export and final/ read
    assert load_recipe(None, []).data.tokenizer == "byte"  # no pretrained model: byte, as before
    bare = _copy(pretrained, tmp_path, "bare")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    assert load_recipe(None, [f"model.pretrained={bare}"]).data.tokenizer == "byte"
    checked, _ = _check(tmp_path, f"model.pretrained={bare}", "model.config={}")
    assert checked.tokenizer.name == "byte" and [w for w in checked.warnings if w.startswith("data.tokenizer:")] == [
        "data.tokenizer: byte (ids 0..256) with model.pretrained's vocabulary of 300: the model trains on byte ids, "
        f"not the tokens it was pretrained on; {bare} holds no tokenizer: set data.tokenizer to the model's "
        "tokenizer directory"]
    # explicit byte with a vocabulary of 300: legal, with a warning line
    checked, _ = _check(tmp_path, f"model.pretrained={pretrained}", "model.config={}", "data.tokenizer=byte")
    assert [w for w in checked.warnings if w.startswith("data.tokenizer:")] == [
        "data.tokenizer: byte (ids 0..256) with model.pretrained's vocabulary of 300: the model trains on byte ids, "
        f"not the tokens it was pretrained on; leave data.tokenizer unset to use the tokenizer in {pretrained}"]


def test_tokenizer_larger_than_the_embeddings(pretrained, tmp_path):
    big = tmp_path / "big-tokenizer"
    _tokenizer(VOCAB + 40).save_pretrained(big)
    assert _error(tmp_path, f"model.pretrained={pretrained}", "model.config={}", f"data.tokenizer={big}") == (
        "embedded recipe 'tiny': data.tokenizer: its 340 token ids do not fit model.pretrained's 300 "
        f"embedding rows (vocab_size in {pretrained / 'config.json'}); use the model's own tokenizer (the default "
        "when data.tokenizer is unset and the pretrained directory holds one)")

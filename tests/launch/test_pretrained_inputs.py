"""model.pretrained inputs (memtrain.model.pretrained, the data.tokenizer default): each mistake one line from the
preflight, before any worker starts and with nothing written; the pretrained directory's own tokenizer used when
data.tokenizer is unset. A tiny Llama saved with save_pretrained beside a small byte-level BPE tokenizer."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import FAST, ROOT, assert_ok, run_train
from memtrain.config.recipe import ModelSection
from memtrain.model.build import build_config, build_model

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
VOCAB = 300  # the tokenizer's size; the model's embeddings have VOCAB rows
OWN = ["--set", "model.config={}"]  # the checkpoint's config as saved (the LoRA recipe's advice)


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


def test_a_run_trains_on_the_pretrained_tokenizers_ids(pretrained, tmp_path):
    """One real run: the packed corpus holds the pretrained tokenizer's ids; config.json records that tokenizer, and
    final/ and `memtrain export` write it."""
    from transformers import AutoTokenizer

    from memtrain.tools.export import export

    run, cache = tmp_path / "run", tmp_path / "cache"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "docs" / "fine-tuning.md").read_text() * 3)
    assert_ok(run_train([*FAST, *OWN, "--set", f"model.pretrained={pretrained}", "--set", f"data.paths=[{corpus}]",
                         "--set", f"data.cache_dir={cache}", "--max-steps", "2", "--run-dir", str(run)]))
    packed = np.fromfile(next(cache.glob("store-*/tokens.bin")), dtype=np.uint16)  # the token store's ids
    want = AutoTokenizer.from_pretrained(pretrained)(corpus.read_text(), add_special_tokens=False)["input_ids"]
    assert packed.max() >= 257 and packed.reshape(-1)[:500].tolist() == want[:500]
    assert json.loads((run / "config.json").read_text())["recipe"]["data"]["tokenizer"] == str(pretrained)
    own = AutoTokenizer.from_pretrained(pretrained).get_vocab()
    for written in (run / "final", export(run)):  # final/, and memtrain export of the last step
        tok = AutoTokenizer.from_pretrained(written)
        assert len(tok) == VOCAB and tok.get_vocab() == own

"""The loss is the mean over every labelled token of the optimizer step (memtrain.model.loss.normalise,
memtrain.train.parallel.Layout.loss_divisor): chat rows with 20 and 200 trained tokens give the same first-step
gradients at micro-batch 4, at micro-batch 1 x accumulation 4 (train.loss standard: the model's own loss), on 2
data-parallel ranks x accumulation 2 (ZeRO-3), and under AutoTP (2 ranks, 1 data-parallel replica), equal to one
token-mean cross-entropy over the batch computed here with plain torch from the pretrained model; the logged loss is
that token mean. Each rank names every rank's rows and their labelled tokens from the data alone
(memtrain.model.order). (Ulysses sequence parallelism refuses chat rows; its loss goes through the same
memtrain.model.loss.normalise: tests/unit/model/test_long_context.py.)"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import ROOT
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.model.build import build_config, build_model
from memtrain.model.chat_data import ChatSamples, PackedChat
from memtrain.model.data import PackedData, RandomTokens, prepare_data, save_tokenizer
from memtrain.train.parallel import Layout
from chatml import TEMPLATE


SEQ = 256
LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": SEQ}


def _rows():
    """6 samples, each alone in a 256-token row: 3 with 20 trained tokens (19 + end of turn), 3 with 200."""
    rng = np.random.default_rng(0)

    def text(n):
        return "".join(rng.choice(list("abcdefgh ")) for _ in range(n))

    short = [[{"role": "user", "content": text(150)}, {"role": "assistant", "content": text(19)}] for _ in range(3)]
    long = [[{"role": "user", "content": text(2)}, {"role": "assistant", "content": text(199)}] for _ in range(3)]
    return [{"messages": m} for pair in zip(short, long) for m in pair]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("token_loss")
    save_tokenizer("byte", tmp / "tok")
    tok = AutoTokenizer.from_pretrained(tmp / "tok")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp / "tok")
    section = ModelSection(type="llama", config=LLAMA)
    torch.manual_seed(0)
    build_model(section, build_config(section, vocab_size=257, seq_len=SEQ)).save_pretrained(tmp / "base")
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    # AutoTP 2 under ZeRO-1: transformers 5.23 does not load a pretrained checkpoint into a ZeRO-3 + AutoTP model
    tp = json.loads((ROOT / "ds_configs" / "zero3_tp2_ckpt.json").read_text())
    tp["zero_optimization"] = {"stage": 1}
    (tmp / "tp2_zero1.json").write_text(json.dumps(tp))
    data = [f"data.paths=[{tmp / 'chat.jsonl'}]", "data.format=chat", f"data.tokenizer={tmp / 'tok'}",
            f"data.seq_len={SEQ}", f"data.cache_dir={tmp / 'cache'}", f"model.pretrained={tmp / 'base'}",
            "model.config={}"]
    return tmp, data


@pytest.mark.parametrize("world, micro, accum", [(1, 4, 1), (2, 1, 2), (3, 2, 5)])
def test_every_rank_counts_the_steps_labelled_tokens_from_the_data(setup, world, micro, accum):
    """labelled_tokens(step) equals the labels of every micro-batch every data rank reads in that step (epochs
    crossed included); on plain text and random tokens the divisor is each micro-batch's own count, as before."""
    tmp, data = setup
    recipe = load_recipe(None, data)
    packed = prepare_data(recipe.data, recipe.train.seed)
    for step in range(4):
        read = sum(int((packed.batch(step, m, r, world, micro, accum)["labels"][:, 1:] != -100).sum())
                   for m in range(accum) for r in range(world))
        assert packed.labelled_tokens(step, world, micro, accum) == read
    # a sample that ends at the row's end: its last token is trained on, its first never is
    mask = np.zeros((3, 8), dtype=np.uint8)
    mask[:, -3:] = 1
    samples = ChatSamples(np.full(24, 7), mask.ravel(), np.arange(0, 25, 8), np.full(3, 3), {}, 256)
    chat = PackedChat(samples, load_recipe(None, ["data.seq_len=8"]).data, 257, 0)
    assert chat.labelled_tokens(0, 1, 3, 1) == 9
    layout = Layout(world=world, tp=1, dp_rank=0, dp_size=world)
    for text in (PackedData(np.zeros((10, 32), dtype=np.uint16), 257, 0), RandomTokens(257, 32, 0)):
        assert layout.loss_divisor(text.labelled_tokens(3, world, micro, accum), accum) == micro * 31

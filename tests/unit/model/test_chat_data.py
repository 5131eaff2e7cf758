"""data.format chat / instruction (memtrain.model.chat_data): labels only on the assistant's tokens, samples packed
whole with no attention across them, bad rows counted in one line, and a trainer run that counts real tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.model import chat_data
from memtrain.model.build import build_config, build_model
from memtrain.model.data import build_tokenizer, prepare_data, save_tokenizer
from chatml import TEMPLATE
TWO_TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A local byte-level tokenizer with a chat template (what a user's tokenizer directory holds)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer("byte", d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


def _model(seq=64):
    section = ModelSection(type="llama", config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                                 "max_position_embeddings": 128})
    torch.manual_seed(0)
    return build_model(section, build_config(section, vocab_size=257, seq_len=seq)).eval()


def test_labels_are_the_assistants_tokens_and_the_loss_is_theirs(tokenizer_dir):
    tok = build_tokenizer(str(tokenizer_dir))
    ids, mask = chat_data.encode_sample(tok.hf, TWO_TURNS)
    text = bytes(int(i) for i in ids if i < 256).decode()
    assert text == "<|system|>be brief<|user|>hi<|assistant|>hello<|user|>2+2?<|assistant|>4"
    trained = [int(i) for i in ids[mask]]
    assert trained == [*b"hello", 256, *b"4", 256]  # each assistant turn and its end-of-turn token, nothing else
    # the model's loss on these labels equals the mean cross-entropy over the assistant tokens, by hand
    ids_t = torch.from_numpy(ids).unsqueeze(0)
    labels = torch.where(torch.from_numpy(mask), ids_t, torch.tensor(-100)).unsqueeze(0)[0:1]
    model = _model()
    with torch.no_grad():
        out = model(input_ids=ids_t, labels=labels)
        logp = torch.log_softmax(out.logits[0].float(), -1)
        targets = [t for t in range(1, len(ids)) if mask[t]]
        by_hand = -sum(logp[t - 1, ids[t]] for t in targets) / len(targets)
    assert out.loss.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_packed_samples_do_not_attend_to_each_other(tokenizer_dir):
    """Two samples in one row, positions restarting: each one's logits equal those of the sample run alone."""
    tok = build_tokenizer(str(tokenizer_dir))
    a = chat_data.encode_sample(tok.hf, TWO_TURNS[1:3])
    b = chat_data.encode_sample(tok.hf, [{"role": "user", "content": "why"}, {"role": "assistant", "content": "so"}])
    ids, labels, positions, real = chat_data.pack([a, b], 64, tok.eos_token_id)
    assert ids.shape == (1, 64) and real.tolist() == [len(a[0]) + len(b[0])]
    assert (labels[0, real[0]:] == -100).all() and positions[0, len(a[0])] == 0  # b restarts at 0
    model = _model()
    with torch.no_grad():
        packed = model(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(positions)).logits[0]
        alone_b = model(input_ids=torch.from_numpy(b[0]).unsqueeze(0)).logits[0]
    start = len(a[0])
    assert (packed[start:start + len(b[0])] - alone_b).abs().max().item() < 1e-4


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bad_rows_are_counted_in_one_line_and_formats_are_checked(tokenizer_dir, tmp_path):
    rows = [{"messages": TWO_TURNS}] * 5 + [
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "long"}]}]
    data = _write(tmp_path / "chat.jsonl", rows)
    recipe = load_recipe(None, [f"data.paths=[{data}]", "data.format=chat", f"data.tokenizer={tokenizer_dir}",
                                "data.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}"])
    packed = prepare_data(recipe.data, 0)
    assert packed.report["samples"] == 5 and packed.report["skipped"] == {
        "no assistant turn": 1, "malformed messages": 1, "longer than data.seq_len": 1}
    line = chat_data.report_line(packed.report, recipe.data)
    assert "\n" not in line and line.startswith("data: chat, 5 samples in ") and "skipped 3 of 8: " in line
    batch = packed.batch(0, 0, 0, 1, 2, 1)
    assert set(batch) == {"input_ids", "labels", "position_ids", "tokens"}
    one = len(chat_data.encode_sample(build_tokenizer(str(tokenizer_dir)).hf, TWO_TURNS)[0])
    assert packed.report["real_tokens"] == 5 * one and int(packed.real.sum()) == 5 * one  # padding is not counted
    assert batch["tokens"] == 2 * one and batch["input_ids"].shape == (2, 128)  # one sample per 128-token row
    # the rows are memory-mapped in narrow dtypes (every rank of a node shares one page-cache copy, not 24 bytes a
    # token of int64 each), and a batch is the packing's int64 rows exactly
    assert isinstance(packed.ids, np.memmap) and packed.ids.dtype == np.uint16 and packed.labels.dtype == np.int32
    tok = build_tokenizer(str(tokenizer_dir))
    ids, labels, positions, _ = chat_data.build(
        [{"messages": r["messages"]} for r in rows], tok, recipe.data)[0]
    rows_read = chat_data.order.micro_rows(len(packed), 0, 0, 0, 0, 1, 2, 1)
    for key, want in (("input_ids", ids), ("labels", labels), ("position_ids", positions)):
        assert batch[key].dtype == torch.int64 and torch.equal(batch[key], torch.from_numpy(want[rows_read])), key
    # instruction rows: prompt and response columns, one user and one assistant turn
    inst = _write(tmp_path / "inst.jsonl", [{"prompt": "say hi", "response": "hi"}, {"prompt": "x", "response": ""}])
    recipe = load_recipe(None, [f"data.paths=[{inst}]", "data.format=instruction", f"data.tokenizer={tokenizer_dir}",
                                "data.seq_len=64", f"data.cache_dir={tmp_path / 'cache'}"])
    packed = prepare_data(recipe.data, 0)
    assert packed.report["samples"] == 1 and packed.report["skipped"] == {"no prompt or response": 1}
    with pytest.raises(UserError, match=r"^data.messages_key: column 'turns' not in "):
        prepare_data(load_recipe(None, [f"data.paths=[{data}]", "data.format=chat", "data.messages_key=turns",
                                        f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'c2'}"]).data, 0)
    with pytest.raises(UserError, match=r"^data.format: 'chat' renders samples with the tokenizer's chat template, "
                                        r"and memtrain's byte tokenizer has none"):
        prepare_data(load_recipe(None, [f"data.paths=[{data}]", "data.format=chat"]).data, 0)

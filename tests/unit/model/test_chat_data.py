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
    samples = chat_data.ChatSamples(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]).astype(np.uint8),
                                    np.cumsum([0, len(a[0]), len(b[0])]), np.array([a[1].sum(), b[1].sum()]), {},
                                    tok.eos_token_id)
    packed = chat_data.PackedChat(samples, load_recipe(None, ["data.seq_len=64"]).data, 257, 0)
    row = packed.rows([0])
    ids, labels, positions, real = (row["input_ids"].numpy(), row["labels"].numpy(), row["position_ids"].numpy(),
                                    packed.real)
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
    # the samples are memory-mapped in narrow dtypes (every rank of a node shares one page-cache copy, not 24 bytes
    # a token of int64 each), and a batch widens only its own rows
    assert isinstance(packed.ids, np.memmap) and packed.ids.dtype == np.uint16 and packed.mask.dtype == np.uint8
    assert all(batch[key].dtype == torch.int64 for key in ("input_ids", "labels", "position_ids"))
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


def _by_hand(conversation) -> tuple[list[int], list[bool]]:
    """TEMPLATE's rendering of a conversation of user and assistant turns, tokenized by hand: the byte tokenizer's
    ids are the text's bytes, and the template's {{ eos_token }} is id 256; the assistant's words and that end of
    turn are the labelled tokens."""
    ids, mask = [], []
    for m in conversation:
        head = f"<|{m['role']}|>".encode() + (m["content"].encode() if m["role"] != "assistant" else b"")
        ids += list(head)
        mask += [False] * len(head)
        if m["role"] == "assistant":
            ids += [*m["content"].encode(), 256]
            mask += [True] * (len(m["content"].encode()) + 1)
    return ids, mask


def _packed_by_hand(samples, seq_len: int):
    """Whole samples, first fit in order, into rows of seq_len, written plainly: (ids, labels, positions) per row,
    EOS 256 and label -100 in a row's tail, positions restarting for each sample and for the tail."""
    rows = []
    for ids, mask in samples:
        row = next((r for r in rows if seq_len - len(r[0]) >= len(ids)), None)
        if row is None:
            rows.append(row := ([], [], []))
        row[0].extend(ids), row[1].extend(i if m else -100 for i, m in zip(ids, mask)), row[2].extend(range(len(ids)))
    return [(ids + [256] * (seq_len - len(ids)), labels + [-100] * (seq_len - len(ids)),
             positions + list(range(seq_len - len(ids)))) for ids, labels, positions in rows]


def _cache_files(cache) -> dict:
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(cache.rglob("*"))
            if p.is_file()}


def test_the_chat_store_packs_as_by_hand_and_a_new_seq_len_or_truncate_renders_nothing(tokenizer_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    """Conversations rendered once into the chat store (ids and assistant mask), then packed at read time: every row
    equals the conversations tokenized by hand with the template and packed first fit, for seq_len 128, 96 and,
    truncated, 48; the second and third open the same store, writing nothing in the cache. Rendered in chunks of 2
    rows by 2 worker processes, the store is byte for byte the one a single process writes, and the one a build
    stopped after 2 chunks (Ctrl-C) and continued writes, and the one prepare-data writes ahead of a job."""
    from memtrain.model import token_store

    monkeypatch.setattr(token_store, "CHUNK_DOCS", 2)
    short = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "so"}]
    long = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "a long answer " * 5}]
    conversations = [TWO_TURNS[1:], short, long, short, TWO_TURNS[1:], short, short]
    data = _write(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    cache = tmp_path / "cache"
    common = [f"data.paths=[{data}]", "data.format=chat", f"data.tokenizer={tokenizer_dir}", "data.workers=2"]
    common_in = [*common, f"data.cache_dir={cache}"]
    by_hand = [_by_hand(c) for c in conversations]
    before = None
    for seq_len, truncate in ((128, False), (96, False), (48, True)):
        recipe = load_recipe(None, [*common_in, f"data.seq_len={seq_len}", f"data.truncate={truncate}"])
        packed = prepare_data(recipe.data, 0)
        if before is not None:
            assert _cache_files(cache) == before  # the same store: nothing rendered or written again
        before = _cache_files(cache)
        fits = [(ids[:seq_len], mask[:seq_len]) for ids, mask in by_hand if truncate or len(ids) <= seq_len]
        want = _packed_by_hand(fits, seq_len)
        got = packed.rows(np.arange(len(packed)))
        assert len(packed) == len(want) > 1, (seq_len, len(packed), len(want))
        for key, k in (("input_ids", 0), ("labels", 1), ("position_ids", 2)):
            assert got[key].tolist() == [row[k] for row in want], (seq_len, key)
        assert packed.report["truncated"] == (sum(len(ids) > seq_len for ids, _ in by_hand) if truncate else 0)
        assert packed.labelled.tolist() == [sum(label != -100 for label in row[1][1:]) for row in want]
    (manifest,) = cache.glob("chat-*/manifest.json")
    assert json.loads(manifest.read_text())["workers"] == 2
    prepare_data(load_recipe(None, [*common, f"data.cache_dir={tmp_path / 'one'}", "data.workers=1"]).data, 0)
    (single,) = (tmp_path / "one").glob("chat-*/")
    from memtrain.model import chat_store, store_progress

    encode_rows, calls = chat_store.encode_rows, []

    def stopped(*args):  # the third chunk: a Ctrl-C
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode_rows(*args)

    monkeypatch.setattr(store_progress, "EVERY_S", 0.0)
    monkeypatch.setattr(chat_store, "encode_rows", stopped)
    stopped_cfg = load_recipe(None, [*common, f"data.cache_dir={tmp_path / 'stopped'}", "data.workers=1"]).data
    with pytest.raises(KeyboardInterrupt):
        prepare_data(stopped_cfg, 0)
    monkeypatch.setattr(chat_store, "encode_rows", encode_rows)
    capsys.readouterr()
    prepare_data(stopped_cfg, 0)
    assert "; continuing from its chunk 2 (4 documents" in capsys.readouterr().err
    (continued,) = (tmp_path / "stopped").glob("chat-*/")
    for name in ("tokens.bin", "offsets.bin", "mask.bin", "trained.bin"):
        assert (single / name).read_bytes() == (manifest.parent / name).read_bytes() == (continued / name).read_bytes()
    # prepare-data builds the same store ahead of a job, and says how the run packs it
    from memtrain.tools.prepare_data import main

    for cache_dir, how in ((cache, "already built"), (tmp_path / "ahead", "built in")):
        main([a for key in [*common, f"data.cache_dir={cache_dir}", "data.seq_len=128"] for a in ("--set", key)])
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"memtrain prepare-data: {len(conversations)} chat samples, "
                               f"{sum(len(ids) for ids, _ in by_hand)} tokens, {how}") and "\n" not in line, line
        assert f"; data: chat, {len(conversations)} samples in 3 rows of 128 tokens (" in line, line
    assert (next((tmp_path / "ahead").glob("chat-*/")) / "tokens.bin").read_bytes() == (single / "tokens.bin").read_bytes()

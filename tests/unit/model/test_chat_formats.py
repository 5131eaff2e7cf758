"""The chat data real datasets bring (memtrain.model.chat_rows, memtrain.model.chat_data), read through `datasets` as a
run reads them (JSON lines and parquet), with a ChatML tokenizer trained here: ShareGPT rows pack to the same ids and labels as the same
conversations in chat rows, tool calls and tool answers included, and the call is trained on; alpaca's input and a
system column reach the prompt; a Qwen3-style template that skips multi-turn rows skips none once data.chat_template
marks the assistant's tokens ({% generation %}); data.truncate keeps an over-long sample's start."""
from __future__ import annotations

import json

import numpy as np

from chatml import chatml_tokenizer
from memtrain.config.recipe import load_recipe
from memtrain.model.data import prepare_data

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's shape: an assistant turn after the last user turn gets an empty think block, earlier ones do not, so a turn
# rendered as the conversation's end differs from the same turn inside a longer conversation
QWEN3 = ("{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = "
         "loop.index0 %}{%- endif %}{%- endfor %}"
         "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
         "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}"
         "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
         "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
         "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _packed(tmp_path, tok, data, *sets):
    recipe = load_recipe(None, [f"data.paths=[{data}]", f"data.tokenizer={tok}", "data.seq_len=256",
                                f"data.cache_dir={tmp_path / 'cache'}", *sets])
    packed = prepare_data(recipe.data, 0)
    every = packed.rows(np.arange(len(packed)))  # every packed row, in order
    packed.all_ids, packed.all_labels = every["input_ids"].numpy(), every["labels"].numpy()
    return packed


def _conversations(tool_args):
    """(ShareGPT rows, the same as chat rows): a tool call and its answer, then a plain exchange."""
    share, chat = [], []
    for args in tool_args:
        call = {"name": "weather", "arguments": args}
        share.append({"conversations": [
            {"from": "system", "value": "be brief"}, {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": json.dumps(call)}, {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "it is sunny"}], "tools": json.dumps([WEATHER])})
        chat.append({"messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "it is sunny"}], "tools": [WEATHER]})
    share.append({"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}], "tools": ""})
    chat.append({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]})
    return share, chat


def test_sharegpt_rows_pack_as_chat_rows_and_the_tool_call_is_trained_on(tmp_path):
    from transformers import AutoTokenizer

    tok = chatml_tokenizer(tmp_path / "tok", TOOLS_TEMPLATE)
    # arguments with different keys per row (Arrow's structs would give every row both)
    share, chat = _conversations([{"city": "Paris"}, {"date": "today"}])
    a = _packed(tmp_path, tok, _write(tmp_path / "share.jsonl", share), "data.format=chat",
                "data.messages_key=conversations")
    b = _packed(tmp_path, tok, _write(tmp_path / "chat.jsonl", chat), "data.format=chat")
    assert a.report["samples"] == b.report["samples"] == 3 and not a.report["skipped"] and not b.report["skipped"]
    assert np.array_equal(a.all_ids, b.all_ids) and np.array_equal(a.all_labels, b.all_labels)
    # parquet stores the messages as Arrow structs: every message and call gets each key any has, None where absent
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    c = _packed(tmp_path, tok, tmp_path / "chat.parquet", "data.format=chat")
    assert np.array_equal(c.all_ids, b.all_ids) and np.array_equal(c.all_labels, b.all_labels)
    hf = AutoTokenizer.from_pretrained(tok)
    first = hf.decode(b.all_ids[0][: b.real[0]])  # rows pack in file order: the first sample starts the first row
    assert '"city": "Paris"' in first and '"date"' not in first.split("<tool_call>")[1].split("</tool_call>")[0]
    trained = hf.decode([int(t) for t in b.all_labels[0] if t != -100])
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in trained
    assert "it is sunny<|im_end|>" in trained and "sunny<|im_end|>\n<|im_start|>assistant" not in trained
    assert '"parameters"' in first  # the row's tools reached the template


def test_alpaca_input_and_system_reach_the_prompt_and_truncate_keeps_the_start(tmp_path):
    from transformers import AutoTokenizer

    tok = chatml_tokenizer(tmp_path / "tok")
    rows = [{"instruction": "translate", "input": "bonjour", "output": "hello", "system": "be brief"},
            {"instruction": "why " * 150, "input": "", "output": "so " * 150, "system": ""}]
    data = _write(tmp_path / "alpaca.jsonl", rows)
    sets = ["data.format=instruction", "data.prompt_key=instruction", "data.response_key=output"]
    packed = _packed(tmp_path, tok, data, *sets)
    hf = AutoTokenizer.from_pretrained(tok)
    prompt = hf.decode([int(t) for t, label in zip(packed.all_ids[0], packed.all_labels[0]) if label == -100])
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ntranslate\nbonjour<|im_end|>")
    assert packed.report["skipped"] == {"longer than data.seq_len": 1}
    cut = _packed(tmp_path, tok, data, *sets, "data.truncate=true")
    assert cut.report["samples"] == 2 and cut.report["truncated"] == 1 and not cut.report["skipped"]
    long = int(np.argmax(cut.real == 256))  # the truncated sample fills its row
    assert hf.decode(cut.all_ids[long][:12]).startswith("<|im_start|>user\nwhy why")


def test_a_qwen3_style_template_skips_multi_turn_rows_unless_data_chat_template_marks_the_assistant(tmp_path):
    from transformers import AutoTokenizer

    stock = QWEN3.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok = chatml_tokenizer(tmp_path / "tok", stock)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                         + [{"role": "user", "content": "why"}, {"role": "assistant", "content": "so"}] * (i % 4 > 0)}
            for i in range(4)]
    data = _write(tmp_path / "chat.jsonl", rows)
    assert _packed(tmp_path, tok, data, "data.format=chat").report["skipped"] == {"template not prefix-stable": 3}
    (tmp_path / "train.jinja").write_text(QWEN3)
    packed = _packed(tmp_path, tok, data, "data.format=chat", f"data.chat_template={tmp_path / 'train.jinja'}")
    assert packed.report["samples"] == 4 and not packed.report["skipped"]
    hf = AutoTokenizer.from_pretrained(tok)
    trained = [hf.decode([int(t) for t in row if t != -100]) for row in packed.all_labels]
    assert "".join(trained).count("<|im_end|>") == 7 and "a1<|im_end|>so<|im_end|>" in "".join(trained)
    assert "think" not in "".join(trained) and "why" not in "".join(trained)

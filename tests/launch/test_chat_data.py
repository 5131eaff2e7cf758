"""data.format chat / instruction (memtrain.model.chat_data): labels only on the assistant's tokens, samples packed
whole with no attention across them, bad rows counted in one line, and a trainer run that counts real tokens."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, run_train
from memtrain.config.recipe import load_recipe
from memtrain.model.data import prepare_data, save_tokenizer
from chatml import TEMPLATE


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


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trainer_trains_on_chat_rows_and_counts_real_tokens(tokenizer_dir, tmp_path):
    """One process through src/train.py: the plan says what was packed and skipped; tokens/s counts the rows'
    real tokens, not their padding. data.chat_template, a Gemma-style template that raises on a system message: that
    row is a counted skip (no traceback), and final/'s tokenizer holds the template."""
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(40)]
    rows.append({"messages": [{"role": "user", "content": "unanswered"}]})
    rows.append({"messages": [{"role": "system", "content": "be brief"}, *rows[0]["messages"]]})
    data = _write(tmp_path / "chat.jsonl", rows)
    # held-out rows, one per packed row (a 110-token sample leaves no room for another in 128): the eval counts
    # each one's assistant tokens, "answer i" and its end-of-turn token, and nothing else
    held_out = _write(tmp_path / "held-out.jsonl", [
        {"messages": [{"role": "user", "content": "q" * 80}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(10)])
    template = tmp_path / "no_system.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}" + TEMPLATE)
    run = tmp_path / "run"
    proc = run_train(["--deepspeed",
                      str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--run-dir", str(run),
                      "--set", f"data.paths=[{data}]", "--set", "data.format=chat",
                      "--set", f"data.tokenizer={tokenizer_dir}", "--set", "data.seq_len=128",
                      "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.micro_batch_size=2",
                      "--set", f"data.chat_template={template}",
                      "--set", "train.max_steps=4", "--set", "train.log_every=4",
                      "--set", "train.metric_warmup_steps=0",  # saves: final/ holds the template
                      "--set", f"data.eval_paths=[{held_out}]", "--set", "train.eval_batches=5"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "data: chat, 40 samples in " in proc.stdout and ("skipped 2 of 42: 1 no assistant turn, 1 template error: "
                                                           "System role not supported") in proc.stdout
    assert "Traceback" not in proc.stderr
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run / "final").chat_template == template.read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_tokens"] == 10 * len("answer 0 ") and 0 < summary["eval_loss"] < 10, summary
    recipe = load_recipe(None, [f"data.paths=[{data}]", "data.format=chat", f"data.tokenizer={tokenizer_dir}",
                                "data.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}",
                                f"data.chat_template={template}"])
    packed = prepare_data(recipe.data, recipe.train.seed)  # the rows the run read, in its order
    real = [packed.batch(s, 0, 0, 1, 2, 1)["tokens"] for s in range(4)]
    m = summary["metrics"]
    per_step = m["throughput/tokens_per_s"] * m["time/step_s"]  # one interval of the 4 steps
    assert per_step == pytest.approx(sum(real) / 4, rel=1e-6) and per_step < 2 * 128  # real tokens, not 256

"""model.lora end to end (memtrain.model.lora): a tiny Llama saved as a local pretrained directory, LoRA under
ZeRO-3 + recompute on 2 CPU ranks with the real launcher (one launch: the run, then a copy of it stopped after
step 4 resumed; tests/trainer_runs.py). final/ holds the merged model and final/adapter the
adapters in peft's format: the pretrained base plus that adapter, loaded by peft itself, gives the merged model's
logits (so the base stayed frozen and the merge is right); a stopped run resumes to a straight run's losses.
Gradients against a plain peft model: tests/launch/test_zero3_hooks.py."""
from __future__ import annotations

import json

import pytest
import torch

from chatml import chatml_tokenizer
from conftest import FAST, ROOT, assert_ok
from memtrain.config.recipe import ModelSection
from memtrain.model.build import build_config, build_model
from memtrain.tools.tb import read_scalars
from trainer_runs import run_in_one_launch

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}


def _chat_rows(n=48):
    return [{"messages": [{"role": "user", "content": f"question {i} " + "why " * (i % 4)},
                          {"role": "assistant", "content": f"answer {i % 7} so brief"}]} for i in range(n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """LoRA with a trainable lm_head (train.trainable, the docs' example) on ChatML chat rows."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("lora")
    tok = chatml_tokenizer(tmp / "tok")
    vocab = len(AutoTokenizer.from_pretrained(tok))
    section = ModelSection(type="llama", config=LLAMA)
    torch.manual_seed(0)
    base = build_model(section, build_config(section, vocab_size=vocab, seq_len=64))
    base.save_pretrained(tmp / "base")
    (tmp / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _chat_rows()))
    args = [*FAST, "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--set", f"model.pretrained={tmp / 'base'}", "--set", "model.config={}",
            "--set", "model.lora.r=4", "--set", "model.lora.target_modules=[q_proj,v_proj,down_proj]",
            "--set", "train.trainable=[lm_head.weight]", "--set", f"data.paths=[{tmp / 'chat.jsonl'}]",
            "--set", "data.format=chat", "--set", f"data.tokenizer={tok}", "--set", f"data.cache_dir={tmp / 'cache'}",
            "--set", "train.save_interval=2", "--set", "train.lr=1e-2"]
    straight, stopped = tmp / "straight", tmp / "stopped"
    # one launch: the straight run, a copy of it stopped after step 4 (conftest.cut_back), that copy resumed
    first, resumed = run_in_one_launch([{"argv": [*args, "--max-steps", "6", "--run-dir", str(straight)]},
                                        {"cut_back": [str(straight), str(stopped), 4]},
                                        {"argv": [*args, "--max-steps", "6", "--run-dir", str(stopped), "--resume"]}],
                                       tmp / "runs.json")
    assert_ok(first)
    assert_ok(resumed)
    return tmp, first, vocab


def test_final_holds_the_merged_model_and_the_adapter_that_reproduces_it(runs):
    """The adapter keeps the trained lm_head (peft's modules_to_save): base + adapter gives final/'s logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, first, vocab = runs
    assert "trainable parameters: " in first.stdout and "LoRA r=4 alpha=16 on q_proj, v_proj, down_proj" in first.stdout
    final = tmp / "straight" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain transformers model
    base = AutoModelForCausalLM.from_pretrained(tmp / "base").eval()
    assert (merged.lm_head.weight - base.lm_head.weight).abs().max().item() > 1e-3  # lm_head trained
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base"), final / "adapter").eval()
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got, untouched = (m(input_ids=ids).logits for m in (merged, adapted, base))
    assert (got - want).abs().max().item() < 1e-4
    assert (want - untouched).abs().max().item() > 1e-3  # the adapters learned something
    # python -m memtrain export of the last model checkpoint writes the same merged model and adapter
    from memtrain.tools.export import export

    out = export(tmp / "straight", 6, tmp / "exported")
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        from_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base"),
                                                 out / "adapter").eval()(input_ids=ids).logits
    assert (exported - want).abs().max().item() < 1e-4 and (from_adapter - want).abs().max().item() < 1e-4
    for name in ("generation_config.json", "tokenizer_config.json"):  # served the same as final/
        assert json.loads((out / name).read_text()) == json.loads((final / name).read_text())
    assert json.loads((out / "config.json").read_text())["use_cache"] is True


def test_final_generates_with_the_kv_cache_and_stops_at_the_end_of_turn(runs):
    """generate() on final/: after the prompt, each step feeds the decoder one new token (the KV cache is on), and
    generation stops at ChatML's <|im_end|> (here forced at the third new token), not only at <|endoftext|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    tmp, _, _ = runs
    for final in (tmp / "straight" / "final",):
        tok = AutoTokenizer.from_pretrained(final)
        model = AutoModelForCausalLM.from_pretrained(final).eval()
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        lengths = []
        forward = model.model.forward

        def spy(*a, **k):
            x = k.get("input_ids") if k.get("input_ids") is not None else k.get("inputs_embeds")
            lengths.append(x.shape[1])
            return forward(*a, **k)

        model.model.forward = spy

        class EndAtThird(LogitsProcessor):
            def __call__(self, input_ids, scores):
                if len(lengths) == 3:
                    scores[:] = -float("inf")
                    scores[:, im_end] = 0
                return scores

        prompt = tok.apply_chat_template([{"role": "user", "content": "why"}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
        n = prompt["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=10, do_sample=False,
                                 logits_processor=LogitsProcessorList([EndAtThird()]))
        assert lengths[0] == n and lengths[1:] == [1] * (len(lengths) - 1), lengths
        assert out.shape[1] == n + 3 and out[0, -1].item() == im_end


def test_a_stopped_lora_run_resumes_to_the_straight_runs_losses(runs):
    tmp, _, _ = runs
    ref = dict(read_scalars(tmp / "straight" / "tb")["train/loss"])
    got = dict(read_scalars(tmp / "stopped" / "tb")["train/loss"])
    assert json.loads((tmp / "stopped" / "summary.json").read_text())["status"] == "completed"
    assert [got[5], got[6]] == [ref[5], ref[6]]

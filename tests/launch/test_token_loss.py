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

from conftest import MAKE_TRAIN_LAUNCHER, ROOT
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.model.build import build_config, build_model
from memtrain.model.data import prepare_data, save_tokenizer
from chatml import TEMPLATE
from trainer_runs import run_in_one_launch

SEQ = 256
LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": SEQ}
# (micro-batch, accumulation, extra flags): every case reads the same 4 rows in its first step
ONE_RANK = {"mb4-ga1": (4, 1, []), "mb1-ga4-standard": (1, 4, ["train.loss=standard"])}
TWO_RANKS = {"mb1-ga2-dp2": (1, 2, []), "mb1-ga4-autotp2": (1, 4, ["tp"])}


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


def _argv(tmp, data, name, micro, accum, extra):
    ds = tmp / "tp2_zero1.json" if "tp" in extra else ROOT / "ds_configs" / "zero3_ckpt.json"
    sets = [*data, f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}", "train.max_steps=1",
            "train.save_checkpoints=false", "train.metric_warmup_steps=0", "train.log_every=1",
            *[e for e in extra if e != "tp"]]
    return ["--deepspeed", str(ds), "--run-dir", str(tmp / name),
            *[a for s in sets for a in ("--set", s)]]


def _worker(tmp, data, cases, nproc):
    runs = [{"argv": _argv(tmp, data, name, *case), "grads": str(tmp / f"{name}.pt")} for name, case in cases.items()]
    proc = run_in_one_launch(runs, tmp / f"runs-{nproc}.json", 0 if nproc == 1 else nproc, timeout=300,
                             launcher=MAKE_TRAIN_LAUNCHER)[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _by_hand(tmp, data):
    """The token-mean cross-entropy over step 1's 4 rows, and the per-row-mean one (the old loss at micro-batch
    1), with their gradients: plain torch on the pretrained model."""
    from transformers import AutoModelForCausalLM

    packed = prepare_data(load_recipe(None, data).data, load_recipe(None, data).train.seed)
    batch = packed.batch(0, 0, 0, 1, 4, 1)  # the step's rows (memtrain's sampler; every case must read them)
    model = AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    nll = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * keep
    counts = keep.sum(dim=1)
    results = []
    for loss in (nll.sum() / counts.sum(), (nll.sum(dim=1) / counts).mean()):
        model.zero_grad()
        loss.backward(retain_graph=True)
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return counts.tolist(), results


def _max_diff(got, want):
    """Largest difference over every parameter; an AutoTP shard (rank 0's: the first slice along the dimension
    it is split on) against that slice of the full gradient."""
    assert sorted(got) == sorted(want)
    worst = 0.0
    for name, full in want.items():
        for dim, (mine, theirs) in enumerate(zip(got[name].shape, full.shape)):
            full = full.narrow(dim, 0, mine) if mine < theirs else full
        worst = max(worst, (got[name] - full).abs().max().item())
    return worst


def test_first_step_gradients_are_the_token_mean_whatever_the_batch_layout(setup):
    tmp, data = setup
    _worker(tmp, data, ONE_RANK, 1)
    _worker(tmp, data, TWO_RANKS, 2)
    counts, [(token_loss, token_grads), (row_loss, row_grads)] = _by_hand(tmp, data)
    assert min(counts) == 20 and max(counts) == 200, counts  # rows with very different trained tokens
    # the case is discriminating: a per-row mean (the old loss at micro-batch 1) gives other gradients
    assert _max_diff(row_grads, token_grads) > 1e-3
    for name in [*ONE_RANK, *TWO_RANKS]:
        grads = torch.load(tmp / f"{name}.pt")
        if "autotp" in name:  # sharded: q_proj, lm_head, ...
            assert grads["lm_head.weight"].shape[0] < 257 and grads["model.layers.0.self_attn.q_proj.weight"].shape[0] < 32
        assert _max_diff(grads, token_grads) < 1e-6, name
        logged = json.loads((tmp / name / "summary.json").read_text())["final_loss"]
        assert logged == pytest.approx(token_loss, abs=1e-5), name  # train/loss: the step's token mean

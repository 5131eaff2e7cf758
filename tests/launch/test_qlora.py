"""model.quantization (QLoRA, memtrain.model.quantize): a tiny Llama saved as a local pretrained directory, its linear
layers in 4 bits with bitsandbytes' CPU backend. The adapters' gradients equal those of a model built directly with
bitsandbytes and peft; one 1-rank ZeRO-3 run writes a final/adapter that loads on the unquantized base and a final/
that is the dequantized base with the adapters merged; the planner's bytes for the 4-bit base equal the real model's;
what cannot compose is one line."""
from __future__ import annotations

import pytest
import torch

from conftest import EVAL_PATHS, FAST, ROOT, assert_ok
from memtrain.config.recipe import ModelSection
from memtrain.errors import UserError
from memtrain.model.build import build_config, build_model
from trainer_runs import run_in_one_launch

bnb = pytest.importorskip("bitsandbytes")

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
VOCAB = 257  # memtrain's byte tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    section = ModelSection(type="llama", config=LLAMA)
    torch.manual_seed(0)
    build_model(section, build_config(section, vocab_size=VOCAB, seq_len=64)).save_pretrained(tmp / "base")
    return tmp


def _reference_4bit(path, double_quant=True, quant_type="nf4"):
    """The unquantized base with every linear layer but lm_head replaced by hand with bitsandbytes' Linear4bit, its
    weight quantized by bitsandbytes on the CPU (the way bitsandbytes documents it), no memtrain code involved."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=False, compute_dtype=torch.float32,
                                      compress_statistics=double_quant, quant_type=quant_type)
            layer.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False,
                                             compress_statistics=double_quant, quant_type=quant_type)
            model.set_submodule(name, layer.to("cpu"))
    model.is_loaded_in_4bit = True
    return model


def test_a_zero3_run_writes_an_adapter_for_the_unquantized_base_and_resumes(base):
    """One rank (no launcher) under ZeRO-3, the 4-bit codes stored by default in the dtype it computes in (float32):
    final/adapter loads on the unquantized pretrained base with peft, and final/ is the dequantized base with those
    adapters merged (its logits equal peft's on a base dequantized by bitsandbytes here). Stopped after step 2 and
    resumed, it logs the straight run's losses at steps 3 and 4. The held-out eval at step 2 (eval mode, no grad)
    leaves the 4-bit weights in bitsandbytes' training layout (its CPU inference repacking would break the save)."""
    import bitsandbytes.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtrain.tools.tb import read_scalars

    run = base / "run"
    args = [*FAST, "--deepspeed", str(ROOT / "ds_configs" / "zero3_ckpt.json"), "--set",
            f"model.pretrained={base / 'base'}", "--set", "model.config={}", "--set", "model.lora.r=4",
            "--set", "model.quantization.bits=4", "--set", "train.lr=1e-2", "--set", "train.save_interval=2",
            "--set", EVAL_PATHS, "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--max-steps", "4"]
    stopped = base / "stopped"
    # one process: the run, a copy of it stopped after step 2 (conftest.cut_back), that copy resumed
    for proc in run_in_one_launch([{"argv": [*args, "--run-dir", str(run)]}, {"cut_back": [str(run), str(stopped), 2]},
                                   {"argv": [*args, "--run-dir", str(stopped), "--resume"]}], base / "runs.json", nproc=0):
        assert_ok(proc)
    straight, resumed = (dict(read_scalars(d / "tb")["train/loss"]) for d in (run, stopped))
    assert [resumed[3], resumed[4]] == [straight[3], straight[4]]
    from memtrain.tools.export import export

    with pytest.raises(UserError, match=r"export of a QLoRA run \(model.quantization\) is not supported"):
        export(run, 4, base / "exported")
    final = run / "final"
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base / "base"), final / "adapter").eval()
    dequantized = _reference_4bit(base / "base")
    for module in dequantized.modules():  # each 4-bit weight as the forward used it, back into a plain Linear
        for name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                plain.weight.data = F.dequantize_4bit(child.weight.data, child.weight.quant_state)
                setattr(module, name, plain)
    dequantized.is_loaded_in_4bit = False
    merged_by_peft = PeftModel.from_pretrained(dequantized, final / "adapter").eval()
    untouched = AutoModelForCausalLM.from_pretrained(base / "base").eval()
    with torch.no_grad():
        want = merged_by_peft(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(final).eval()(input_ids=ids).logits
        near, plain = on_base(input_ids=ids).logits, untouched(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (want - plain).abs().max().item() > 1e-3  # the adapters learned something
    assert torch.isfinite(near).all() and (near - plain).abs().max().item() > 1e-3  # they apply to the plain base

"""model.quantization (QLoRA, memtrain.model.quantize): a tiny Llama saved as a local pretrained directory, its linear
layers in 4 bits with bitsandbytes' CPU backend. The adapters' gradients equal those of a model built directly with
bitsandbytes and peft; one 1-rank ZeRO-3 run writes a final/adapter that loads on the unquantized base and a final/
that is the dequantized base with the adapters merged; the planner's bytes for the 4-bit base equal the real model's;
what cannot compose is one line."""
from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from memtrain.config.recipe import ModelSection, load_recipe
from memtrain.errors import UserError
from memtrain.model.build import build_config, build_model

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


def test_adapter_gradients_equal_a_plain_peft_and_bitsandbytes_model(base):
    """memtrain's path (the pretrained base built, quantized, adapted, frozen, with the fused loss) against peft's own
    QLoRA recipe on the hand-built 4-bit model: the same adapter gradients within 1e-5."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from memtrain.model.freeze import freeze
    from memtrain.model.lora import add_lora, trainable_patterns
    from memtrain.model.loss import install_loss
    from memtrain.model.quantize import quantize_base

    recipe = load_recipe(None, [f"model.pretrained={base / 'base'}", "model.config={}", "model.lora.r=4",
                                "model.quantization.type=nf4"])
    ours = build_model(recipe.model, build_config(recipe.model, vocab_size=VOCAB, seq_len=64))
    assert quantize_base(ours, recipe.model.quantization, "float32", "cpu") == 14  # 7 linear layers x 2, not lm_head
    add_lora(ours, recipe.model.lora)
    assert type(ours.model.layers[0].mlp.down_proj).__module__ == "peft.tuners.lora.bnb"  # peft's 4-bit LoRA layer
    freeze(ours, trainable_patterns(ours, recipe.model.lora, []))
    install_loss(ours, fused=True)
    reference = prepare_model_for_kbit_training(_reference_4bit(base / "base"), use_gradient_checkpointing=False)
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at 0: give it values, the same in both, so that lora_A gets gradients too
        for (name, mine), (_, theirs) in zip(ours.named_parameters(), reference.base_model.model.named_parameters()):
            if "lora_B" in name:
                mine.copy_(0.1 * torch.randn_like(mine))
            if "lora_" in name:
                theirs.copy_(mine)
            elif mine.dtype == torch.uint8:  # the same 4-bit codes
                assert torch.equal(mine, theirs), name
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    ours(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    want = {n.removeprefix("base_model.model."): p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert sorted(got) == sorted(want) and len(got) == 28 and all("lora_" in n for n in got)
    assert max(g.abs().max().item() for g in want.values()) > 1e-3
    assert max((got[n] - want[n]).abs().max().item() for n in got) < 1e-5


def _real_bytes(model) -> int:
    """Every tensor the model holds, once: parameters (the packed 4-bit codes included), buffers, and bitsandbytes'
    quant states (absmax, codes, offset, the nested absmax and its code)."""
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            nested = (state.state2.absmax, state.state2.code) if state.nested else ()
            for t in (state.absmax, state.code, state.offset, *nested):
                if t is not None:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("double_quant", [True, False])
def test_planner_counts_the_4bit_base_within_1_percent(double_quant):
    """The planner's parameter bytes (memtrain.memory.states: 4-bit codes, quant states, the rest in its dtype, the
    adapters) against the real quantized model's tensors, counted one by one."""
    from memtrain.memory.profile import profile_activations
    from memtrain.memory.states import model_states
    from memtrain.memory.target import make_target, model_and_config
    from memtrain.model.lora import add_lora
    from memtrain.model.quantize import quantize_base

    shape = {**LLAMA, "hidden_size": 256, "intermediate_size": 704}
    recipe = load_recipe(None, ["model.config=" + str(shape).replace("'", ""), "model.lora.r=4", "data.seq_len=64",
                                f"model.quantization.double_quant={str(double_quant).lower()}",
                                "train.micro_batch_size=1"])
    ds = {"train_micro_batch_size_per_gpu": 1}
    config = model_and_config(recipe)
    target = make_target(recipe, ds, 1, "cpu")
    states = model_states(profile_activations(config, target, ("keep",)), ds, target)
    model = build_model(recipe.model, config)
    dense = _real_bytes(model)
    quantize_base(model, recipe.model.quantization, "float32", "cpu")
    add_lora(model, recipe.model.lora)
    real = _real_bytes(model)
    assert real < 0.45 * dense  # most of the model is in its linear layers
    assert abs(states.params - real) <= 0.01 * real
    assert states.dequantized == 4 * 256 * 704  # the largest 4-bit weight (gate/up/down), dequantized in float32


def test_what_a_4bit_base_cannot_run_with_is_one_line():
    from memtrain.train.qlora_checks import check_quantized_base

    qlora = ["model.lora.r=4", "model.quantization.bits=4"]
    zero3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with pytest.raises(UserError, match=r"^recipe 'tiny' .*: model.quantization.bits: .*only 4-bit bases"):
        load_recipe(None, ["model.lora.r=4", "model.quantization.bits=8"])
    with pytest.raises(UserError, match=r"^recipe 'tiny' .*: model: .*model.quantization needs model.lora"):
        load_recipe(None, ["model.quantization.bits=4"])
    cases = [
        (zero3, ["model.quantization.storage_dtype=uint8"], r"^j.json: zero_optimization.stage: 3 partitions .*"
                                                            r"storage_dtype is uint8; set model.quantization."
                                                            r"storage_dtype: bfloat16$"),
        ({"bf16": {"enabled": True}}, ["model.quantization.storage_dtype=float32"],
         r"^j.json: DeepSpeed computes in bfloat16 and would cast the 4-bit codes"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
         ["model.quantization.storage_dtype=float32"], r"^j.json: zero_optimization.offload_param: a 4-bit base"),
        ({}, ["parallel.sequence=2"], r"^j.json: parallel.sequence 2 with model.quantization"),
    ]
    for ds, more, message in cases:
        with pytest.raises(UserError, match=message):
            check_quantized_base(ds, load_recipe(None, [*qlora, *more]), "j.json", compiled=False)
    with pytest.raises(UserError, match=r"^j.json: train.compile with model.quantization"):
        check_quantized_base({}, load_recipe(None, qlora), "j.json", compiled=True)
    bf16 = load_recipe(None, [*qlora, "model.quantization.storage_dtype=bfloat16"])
    check_quantized_base(zero3, bf16, "j.json", False)
    check_quantized_base(zero3, load_recipe(None, qlora), "j.json", False)  # the default: the dtype it computes in
    check_quantized_base({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, load_recipe(None, qlora),
                         "j.json", False)  # uint8 codes are never cast


def test_gpu_check_runs_lora_beside_qlora():
    """make gpu-check's set-ups: `+qlora` adds LoRA on a 4-bit NF4 base to the trainer's recipe (ZeRO-3, every GPU)."""
    from memtrain.tools.bench.__main__ import GPU_CHECK_SETUPS
    from memtrain.tools.bench.setups import ADAPTERS, parse_setup

    assert {"memtrain:full+lora", "memtrain:full+qlora"} <= set(GPU_CHECK_SETUPS)
    s = parse_setup("memtrain:full+offload+qlora")
    assert (s.ac, s.cpu_checkpointing, s.adapters) == ("full", True, "qlora")
    assert s.label.endswith("QLoRA (4-bit NF4 base)")
    recipe = load_recipe(None, list(ADAPTERS[s.adapters]))
    assert recipe.model.quantization.type == "nf4" and recipe.model.lora.r == 16


def test_plan_search_keeps_to_what_a_4bit_base_runs_with():
    """make plan --search on a QLoRA recipe: Ulysses and offload_param, which preflight refuses with a 4-bit base,
    are dropped with their reason, never proposed."""
    from memtrain.config.ds_config import load_ds_config
    from memtrain.memory.hardware import load_hardware
    from memtrain.memory.search import search

    recipe = load_recipe(None, ["data.seq_len=64", "model.lora.r=4", "model.quantization.bits=4"])
    result = search(recipe, load_ds_config(ROOT / "ds_configs" / "zero3_ckpt.json"),
                    load_hardware(ROOT / "hardware" / "h100-sxm-8x.yaml"), 1, 64 * 8 * 4, host_budget=1 << 40,
                    micro_batches=(1, 4), exact_top=0)  # which configs are proposed: re-scoring the best adds none
    reasons = dict(result.dropped)
    assert any(r.startswith("SP with model.quantization") for r in reasons), reasons
    assert any(r.startswith("offload_param with model.quantization") for r in reasons), reasons
    assert result.scored and all(s.config.sp == 1 and s.config.tp == 1 and not s.config.offload_param
                                 for s in result.scored)

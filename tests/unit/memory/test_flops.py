"""memtrain.memory.flops against torch's FlopCounterMode on one CPU training step of small models."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import plan_for
from memtrain.memory.flops import (attention_score_recompute_flops_per_token, device_peak_tflops, model_flops_per_token, recompute_flops_per_token)

SEQ, BATCH, VOCAB = 32, 2, 128
BASE = dict(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64)
FAMILIES = {
    "llama": BASE,
    "mistral": BASE,
    "qwen2": BASE,
    "qwen3": dict(BASE, head_dim=32),  # heads·head_dim = 128 != hidden 64
    "qwen3_moe": dict(BASE, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
    "mixtral": dict(BASE, num_local_experts=8, num_experts_per_tok=2),
    "gpt2": dict(n_embd=64, n_layer=2, vocab_size=VOCAB, n_head=4, n_positions=64),  # tied head, resid dropout
}


def _model(type_, attn="eager", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(type_, use_cache=False, **FAMILIES[type_], **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return config, model.train()


def _counted(model, plan=None) -> int:
    """FLOPs FlopCounterMode counts for one forward+backward, with `plan` (memtrain.recompute policy)."""
    if plan:
        apply_plan(model, plan_for(plan, model.config.num_hidden_layers, backend="torch"))
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x, labels=x).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("type_", FAMILIES)
def test_model_flops_match_flop_counter(type_):
    # eager attention: plain matmuls, whose backward is exactly 2x the forward, as modelled
    config, model = _model(type_)
    if type_ == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: the head matmul still runs
    counted = _counted(model)
    # exact by construction; 0.1% rather than 2% so that small terms (the MoE router) count too
    assert model_flops_per_token(config, SEQ) * BATCH * SEQ == pytest.approx(counted, rel=1e-3)


def test_fused_attention_adds_its_score_recompute():
    # SDPA's CPU flash kernel (formula registered by memtrain.memory.flops, like torch's CUDA ones)
    # recomputes Q·K^T in its backward; the counter sees it, model FLOPs do not include it
    config, model = _model("llama", attn="sdpa")
    counted = _counted(model)
    model_flops = model_flops_per_token(config, SEQ) * BATCH * SEQ
    extra = attention_score_recompute_flops_per_token(config, SEQ) * BATCH * SEQ
    assert model_flops + extra == pytest.approx(counted, rel=0.002)
    assert model_flops != pytest.approx(counted, rel=0.002)


def test_grouped_mm_formula():
    assert torch.ops.aten._grouped_mm in flop_registry
    a = torch.randn(12, 16, requires_grad=True)  # 12 rows over 3 groups
    b = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        out = torch._grouped_mm(a, b, offs=offs)
        out.backward(torch.randn_like(out))
    assert counter.get_total_flops() == 3 * 2 * 12 * 16 * 8  # forward, grad of a, grad of b


@pytest.mark.parametrize("type_, plans", [
    ("llama", ["full", "selective:attn", "selective:mlp", "op", "first:1"]),
    ("mixtral", ["full", "selective:attn", "selective:mlp", "op"]),
    ("gpt2", ["full", "selective:attn", "selective:mlp"]),  # resid dropout: last projections recomputed
])
def test_recompute_flops_match_flop_counter(type_, plans):
    config, model = _model(type_)
    base = _counted(model)
    for policy in plans:
        config, model = _model(type_)
        layers = plan_for(policy, config.num_hidden_layers, backend="torch").layers
        measured = _counted(model, policy) - base
        predicted = recompute_flops_per_token(config, SEQ, layers) * BATCH * SEQ
        assert predicted == pytest.approx(measured, rel=1e-3, abs=1), (policy, layers)


def test_recompute_stops_before_the_last_projection():
    # without residual dropout, non-reentrant checkpoint never reruns a unit's final matmul
    config, _ = _model("gpt2", resid_pdrop=0.0)
    h, inter = 64, 4 * 64
    per_token = {m: recompute_flops_per_token(config, SEQ, (m, "keep")) for m in ("full", "attn", "mlp", "keep")}
    assert per_token["mlp"] == 2 * h * inter  # c_fc only, not c_proj
    assert per_token["attn"] == 2 * h * 3 * h + 4 * SEQ * h  # c_attn and attention, not c_proj
    assert per_token["full"] == per_token["attn"] + 2 * h * h + per_token["mlp"]
    assert per_token["keep"] == 0
    with pytest.raises(ValueError):
        recompute_flops_per_token(config, SEQ, ("everything",))


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA B200", 2250.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA A10G", 125.0),
    ("AMD Instinct MI300X", 1307.4),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA RTX A1000 6GB Laptop GPU", None),  # whole names only: not an A100
])
def test_device_peak_tflops(name, peak):
    assert device_peak_tflops(name) == peak


def test_device_peak_tflops_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_peak_tflops() is None

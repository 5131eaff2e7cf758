"""Training FLOPs from a transformers config (model FLOPs, recompute FLOPs), FlopCounterMode formulas, device peaks.

Everything here is computed from the config's real shapes, never from a model instance, so the
planner can use it before a model exists. Counting convention (the one
`torch.utils.flop_counter.FlopCounterMode` uses, so the two can be compared op for op):

* a matmul (m, k) @ (k, n) is 2·m·k·n FLOPs; biases, norms, activations, softmax, rotary
  embeddings, the loss and the embedding lookup (not a matmul) are not counted;
* attention scores and attention-weighted values are counted over the full s×s square, causal
  or not (FlopCounterMode's sdpa formulas do the same: "we aren't accounting for causal
  attention"), i.e. 4·s·(heads·head_dim) forward FLOPs per token and layer;
* training = forward + backward = 3 × forward (the backward of every matmul is two matmuls of the
  same size: gradient of the input and of the weight). This is PaLM's "model FLOPs" (appendix B).

Fused attention kernels (flash / memory-efficient / cuDNN SDPA) also recompute Q·K^T in their
backward: FlopCounterMode counts 5 backward matmuls for them instead of 4. Those are hardware
FLOPs, not model FLOPs: `attention_score_recompute_flops_per_token` gives them separately.
Eager/math attention has no such recompute.

MFU = model_flops_per_token · tokens / time / peak;
HFU = (model_flops_per_token + recompute_flops_per_token) · tokens / time / peak.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula, sdpa_backward_flop_count, \
    sdpa_flop_count, shape_wrapper

from memtrain.recompute.policy import OP_GROUPS

# --------------------------------------------------------------------------- shapes

# Families whose MLP is up -> activation -> down (no gate). Everything else is treated as a gated
# MLP (gate, up, down: llama, mistral, qwen*, gemma, ...), which is what most current decoders use.
_UNGATED = {"gpt2", "gpt_neo", "gptj", "gpt_neox", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "codegen",
            "starcoder2", "mpt", "biogpt", "xglm"}
# Config keys of a dropout applied right after a sublayer's output projection (gpt2's resid_pdrop):
# it saves a mask computed from that projection's output, which decides what a checkpoint recomputes.
_RESID_DROPOUT = ("resid_pdrop", "resid_dropout", "hidden_dropout", "hidden_dropout_prob")


@dataclass(frozen=True)
class _Layer:
    """Forward FLOPs per token of one decoder layer, by the parts a checkpoint recomputes."""

    qkv: float  # q, k and v projections
    core: float  # scores and attention-weighted values, full s×s
    out: float  # attention output projection
    mlp_in: float  # everything in the MLP but its final dense projection (router and experts included)
    mlp_out: float  # the MLP's final dense projection (0 for MoE: counted in mlp_in)
    grouped: float  # expert matmuls that run as aten._grouped_mm
    moe: bool
    resid_dropout: bool

    @property
    def forward(self) -> float:
        return self.qkv + self.core + self.out + self.mlp_in + self.mlp_out


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _num_experts(config) -> int:
    return int(_get(config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)


def _is_sparse(config, idx: int) -> bool:
    """Whether layer `idx` has an MoE MLP (qwen*_moe: decoder_sparse_step, mlp_only_layers;
    deepseek: first_k_dense_replace)."""
    if not _num_experts(config):
        return False
    if idx in (_get(config, "mlp_only_layers", default=()) or ()):
        return False
    if idx < int(_get(config, "first_k_dense_replace", default=0)):
        return False
    step = int(_get(config, "decoder_sparse_step", "moe_layer_freq", default=1) or 1)
    return (idx + 1) % step == 0


def _layers(config, seq_len: int) -> list[_Layer]:
    hidden = int(_get(config, "hidden_size", "n_embd", "d_model"))
    heads = int(_get(config, "num_attention_heads", "n_head"))
    kv_heads = int(_get(config, "num_key_value_heads", default=heads))
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv = 2 * hidden * (q_dim + 2 * kv_dim)
    core = 4 * seq_len * q_dim
    out = 2 * q_dim * hidden
    gated = getattr(config, "model_type", None) not in _UNGATED
    mats = 3 if gated else 2
    inter = int(_get(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    resid_dropout = any((getattr(config, k, 0) or 0) > 0 for k in _RESID_DROPOUT)

    experts = _num_experts(config)
    top_k = int(_get(config, "num_experts_per_tok", "moe_topk", "top_k", default=1))
    expert_inter = int(_get(config, "moe_intermediate_size", default=inter))
    # transformers 5 runs routed experts through torch._grouped_mm unless told otherwise
    grouped_impl = (getattr(config, "_experts_implementation", None) or "grouped_mm") == "grouped_mm"
    layers = []
    for idx in range(int(_get(config, "num_hidden_layers", "n_layer"))):
        if _is_sparse(config, idx):
            routed = top_k * mats * 2 * hidden * expert_inter  # only the active experts run
            shared = mats * 2 * hidden * int(_get(config, "shared_expert_intermediate_size", default=0))
            shared += mats * 2 * hidden * expert_inter * int(_get(config, "n_shared_experts", default=0))
            if getattr(config, "shared_expert_intermediate_size", None):
                shared += 2 * hidden  # qwen2_moe's sigmoid gate on the shared expert
            router = 2 * hidden * experts
            layers.append(_Layer(qkv, core, out, router + routed + shared, 0.0, routed if grouped_impl else 0.0,
                                 True, resid_dropout))
        else:
            layers.append(_Layer(qkv, core, out, (mats - 1) * 2 * hidden * inter, 2 * inter * hidden, 0.0,
                                 False, resid_dropout))
    return layers


def _head(config) -> float:
    """The LM head matmul per token; a tied head still runs it (the input lookup is no matmul)."""
    return 2.0 * int(_get(config, "hidden_size", "n_embd", "d_model")) * int(config.vocab_size)


# --------------------------------------------------------------------------- public API

def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs (forward + backward = 3 × forward) per token at sequence length `seq_len`,
    without any recompute, from the config's real shapes: q/o over heads·head_dim, k/v over the
    GQA key/value heads, gated or plain MLP, MoE with only the top-k active (plus shared) experts
    and the router, full s×s attention, and the LM head (tied or not)."""
    forward = sum(layer.forward for layer in _layers(config, seq_len)) + _head(config)
    return 3.0 * forward


def attention_score_recompute_flops_per_token(config, seq_len: int) -> float:
    """FLOPs per token a fused attention kernel's backward (flash, memory-efficient, cuDNN SDPA)
    spends recomputing Q·K^T: 2·s·heads·head_dim per layer. FlopCounterMode counts them for those
    kernels (and for SDPA's CPU flash kernel once this module is imported), not for eager or math
    attention. Not part of model FLOPs; hardware FLOPs when such a kernel runs."""
    return sum(layer.core / 2 for layer in _layers(config, seq_len))


def recompute_flops_per_token(config, seq_len: int, layers: tuple[str, ...]) -> float:
    """Extra forward FLOPs per token that activation recompute adds for a per-layer plan
    (`memtrain.recompute` modes, one per decoder layer): "keep" nothing, "full" the decoder layer,
    "attn" the attention sublayer, "mlp" the MLP sublayer, "op" torch selective AC saving
    matmuls and attention outputs.

    Modelled on torch.utils.checkpoint(use_reentrant=False), which memtrain's torch backend uses,
    as measured with FlopCounterMode (tests/unit/memory/test_flops.py): its recompute stops early, as soon
    as every tensor the backward needs has been recomputed, so the unit's last ops run only if
    something in the unit saved their output. Hence:

    * "attn" skips the output projection (its output only feeds the residual add) unless a
      residual dropout follows it (gpt2's resid_pdrop > 0 saves a mask computed from it);
    * "mlp" skips a dense MLP's down projection (same rule); an MoE MLP is recomputed whole
      (the routing-weight multiply saves the experts' outputs);
    * "full" recomputes the attention sublayer whole (the next norm saves the residual it feeds)
      and the MLP as "mlp" does;
    * "op" recomputes no mm/addmm/bmm nor attention kernel; routed experts running as
      aten._grouped_mm are recomputed while memtrain.recompute's "matmul" op group lacks _grouped_mm.

    A plan shorter than the model covers its first layers only.
    """
    grouped_saved = "_grouped_mm" in OP_GROUPS.get("matmul", ())
    total = 0.0
    for layer, mode in zip(_layers(config, seq_len), layers):
        attn = layer.qkv + layer.core + layer.out
        mlp = layer.mlp_in + (layer.mlp_out if layer.resid_dropout else 0.0)  # mlp_out is 0 for MoE
        if mode == "keep":
            continue
        if mode == "full":
            total += attn + mlp
        elif mode == "attn":
            total += attn - (0.0 if layer.resid_dropout else layer.out)
        elif mode == "mlp":
            total += mlp
        elif mode == "op":
            total += 0.0 if grouped_saved else layer.grouped
        else:
            raise ValueError(f"unknown layer mode {mode!r}: expected keep, full, attn, mlp or op")
    return total


# --------------------------------------------------------------------------- FlopCounterMode formulas

def _register_flop_formulas() -> None:
    """Teach FlopCounterMode the ops it does not count: aten._grouped_mm (MoE experts in
    transformers 5; torch 2.13 has no formula) and SDPA's CPU flash-attention kernel and its
    backward (counted like the CUDA SDPA kernels, grouped-query shapes included)."""
    aten = torch.ops.aten
    if hasattr(aten, "_grouped_mm") and aten._grouped_mm not in flop_registry:
        @register_flop_formula(aten._grouped_mm)
        def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            # 2D x 2D (weight gradient): (m, k_total) @ (k_total, n) split along k by offs into
            # (groups, m, n): 2·m·k_total·n. Otherwise the contraction is a's last dim:
            # 2D x 3D (m, k) @ (g, k, n) -> (m, n); 3D x 2D -> (m, n_total); 3D x 3D -> (g, m, n).
            # Rows past offs[-1] are skipped by the kernel; shapes alone cannot see that, and
            # transformers passes exactly tokens·top_k rows, all of them inside offs.
            if len(a_shape) == 2 and len(b_shape) == 2:
                return 2 * a_shape[0] * a_shape[1] * b_shape[1]
            return 2 * math.prod(out_shape) * a_shape[-1]

    # transformers' fallback for it (memtrain.model.moe: MoE experts in fp32/fp16), a custom op: (S, k) @ (E, k, n)
    # by offs -> (S, n) forward; its backward computes the input's and the weights' gradients, twice that
    import transformers.integrations.moe  # noqa: F401, PLC0415 transformers: heavy, only here (defines the transformers:: ops)

    # Which of them exist depends on the transformers version (5.17, on the lent GPU image, has no backward op):
    # count those that are there.
    ops = torch.ops.transformers
    forward, backward = (getattr(ops, name, None) for name in ("grouped_mm_fallback", "grouped_mm_fallback_backward"))
    if forward is not None and forward not in flop_registry:
        @register_flop_formula(forward)
        def _fallback_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
            return 2 * a_shape[0] * a_shape[1] * b_shape[2]

    if backward is not None and backward not in flop_registry:
        @register_flop_formula(backward)
        def _fallback_backward_flop(a_shape, b_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
            return 4 * a_shape[0] * a_shape[1] * b_shape[2]

    # SDPA: the CPU flash kernel (torch counts only the CUDA ones), and grouped-query shapes for all
    # of them (torch < 2.13, e.g. the 2.11 of the GPU image, asserts on K/V with fewer heads than Q;
    # the kernels broadcast K/V to the query heads, so that is what is counted). Replacing torch's
    # own CUDA entries with these gives its 2.13 counts on any version.

    def broadcast(query, key, value):
        heads = query[1]
        return query, (*key[:1], heads, *key[2:]), (*value[:1], heads, *value[2:])

    def sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(*broadcast(query_shape, key_shape, value_shape))

    def sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, *broadcast(query_shape, key_shape, value_shape))

    for kernel in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        for op, formula in ((getattr(aten, kernel, None), sdpa), (getattr(aten, kernel + "_backward", None),
                                                                 sdpa_backward)):
            if op is not None:
                flop_registry[op] = shape_wrapper(formula)


_register_flop_formulas()  # at import; FlopCounterMode copies the registry when constructed


# --------------------------------------------------------------------------- device peaks

# Dense (not 2:4 sparse) BF16 tensor-core peak TFLOP/s, from the vendors' datasheets; NVIDIA's
# tables quote sparse figures with an asterisk, halved here. First match wins: more specific names
# first (GH200 before H200, L40S before L40 before L4). Matched against the full device name.
_PEAKS: tuple[tuple[str, float], ...] = (
    (r"\bMI300X\b", 1307.4),  # AMD Instinct MI300X datasheet: 1307.4 TFLOPS BF16 dense
    (r"\bGH200\b", 989.0),  # NVIDIA GH200 Grace Hopper datasheet: 1,979 sparse
    (r"\bH200\b.*\bNVL\b", 835.0),  # NVIDIA H200 datasheet, H200 NVL: 1,671 sparse
    (r"\bH200\b", 989.0),  # NVIDIA H200 datasheet, H200 SXM: 1,979 sparse
    (r"\bH100\b.*\bNVL\b", 835.0),  # NVIDIA H100 datasheet, H100 NVL: 1,671 sparse
    (r"\bH100\b.*\bPCIe\b", 756.0),  # NVIDIA H100 datasheet, H100 PCIe: 1,513 sparse
    (r"\bH100\b", 989.0),  # H100 SXM5 ("NVIDIA H100 80GB HBM3"): 1,979 sparse
    (r"\bB200\b", 2250.0),  # NVIDIA HGX B200 datasheet: 4.5 PFLOPS sparse per GPU
    (r"\bA100\b", 312.0),  # NVIDIA A100 datasheet: 312 dense, SXM4 and PCIe alike
    (r"\bL40S\b", 362.0),  # NVIDIA L40S datasheet: 362.05 dense (733 sparse)
    (r"\bL40\b", 181.0),  # NVIDIA L40 datasheet: 181.05 dense (362.1 sparse)
    (r"\bL4\b", 121.0),  # NVIDIA L4 datasheet: 242 sparse
    (r"\bA10G\b", 125.0),  # approx.: AWS's A10G is an A10 variant; NVIDIA A10 datasheet 125 dense
)


def device_peak_tflops(name: Optional[str] = None) -> Optional[float]:
    """Dense BF16 peak TFLOP/s of a device from its full name (`torch.cuda.get_device_name()`,
    e.g. "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe", "NVIDIA H100 NVL").
    `name=None`: the current CUDA device, None without CUDA. Unknown devices: None."""
    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    return next((peak for pattern, peak in _PEAKS if re.search(pattern, name, re.IGNORECASE)), None)


class _Totals:
    """Stands in for FlopCounterMode's per-module tracker: its hooks on every module output
    would keep recomputed tensors alive through the backward (inflating peak_backward_bytes)."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def flop_counter():
    """FlopCounterMode totals only (no per-module tracking), with memtrain's formulas registered."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _Totals()
    return counter

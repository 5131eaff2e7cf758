"""Tiny configs of the transformers decoder families memtrain covers (issue 27's matrix): transformers' own
config classes only, nothing downloaded. 4 layers, hidden 64, 4 heads (2 KV heads where the family has GQA),
each family's default dropout. Gemma-2 alternates sliding-window and full-attention layers by default; Gemma-3
is given the same alternation, so that sqrt segments meet per-layer arguments in both."""
import json

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}
FAMILIES = {
    "llama": BASE,
    "qwen2": BASE,
    "qwen3": {**BASE, "head_dim": 16},
    "mistral": BASE,
    "gemma": {**BASE, "head_dim": 16, "pad_token_id": 0},
    "gemma2": {**BASE, "head_dim": 16, "pad_token_id": 0, "sliding_window": 16},
    "gemma3_text": {**BASE, "head_dim": 16, "pad_token_id": 0, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
    "phi3": {**BASE, "pad_token_id": 0},
    "olmo2": {**BASE, "pad_token_id": 0},
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256},
    "gpt_neox": {k: v for k, v in BASE.items() if k != "num_key_value_heads"},
    "opt": {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "max_position_embeddings": 256, "word_embed_proj_dim": 64},
    "falcon": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "new_decoder_architecture": True, "num_kv_heads": 2},
    "starcoder2": BASE,
    "granite": BASE,
    "mixtral": {**BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**BASE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 128},
    "qwen3_moe": {**BASE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
}
# the one policy a family's layers cannot take, and the start of the line that says so
REFUSED = {("opt", "selective:mlp"): "OPTDecoderLayer has no mlp sublayer"}
# what DeepSpeed's AutoTP cannot shard (0.19.8), and why: one line before workers start
AUTOTP_REFUSED = {"phi3": "rowwise_split_input", "olmo2": "rowwise_split_input", "gpt2": "has no policy for gpt2",
                  "mixtral": "moe_tp_experts", "qwen2_moe": "moe_tp_experts", "qwen3_moe": "moe_tp_experts"}
# what Ulysses sequence parallelism (DeepSpeed 0.19.8) cannot run, and why: one line before workers start
SP_REFUSED = {"gemma2": "attn_implementation sdpa or a flash attention (got eager",
              "gemma3_text": "sliding-window attention (16 tokens, under data.seq_len 64)",
              "falcon": "FalconForCausalLM calls its attention kernel itself",
              "gpt2": "GPT2Attention splits the attention output back into heads"}
# for the gradient comparison with one full-sequence rank: dropout off (a rank's slice draws other masks than
# the whole sequence), and Gemma-3 again with a window no shorter than the sequence (then it runs)
SP_CONFIG = {"opt": {"dropout": 0.0}, "gemma3_text": {"sliding_window": 64}}
# one Ulysses registration per process serves one head layout: 4 heads with 4 key/value heads run in
# tests/zero3_worker.py, the families with 2 key/value heads in tests/long_context_worker.py
SP_MHA = ["gpt_neox", "opt"]
SP_GQA = [f for f in FAMILIES if f not in SP_MHA and (f not in SP_REFUSED or f in SP_CONFIG)]


def overrides(family: str) -> list[str]:
    """The recipe overrides (`--set` values) that select the family's tiny config."""
    return [f"model.type={family}", f"model.config={json.dumps(FAMILIES[family])}"]

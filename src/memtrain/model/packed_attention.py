"""Whether a model keeps the samples of a packed row apart: measured, before any worker, on a small copy of it.

Chat and instruction rows pack whole samples with positions restarting at 0 (memtrain.model.chat_data). transformers
keeps them apart where the model hands its position ids to `create_causal_mask` (the mask then blocks attention across
samples); OPT and Falcon (transformers 5.23) do not, so a packed sample would attend to the samples before it and
train on the wrong context, silently. Which models do is the model's code, not its config, so it is measured: a
2-layer copy of the config with small widths runs one packed row and the row's last sample alone, on CPU in fp32,
with the config's attention where it runs on CPU (eager or sdpa; else the family's default); the sample's logits
must agree.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch

from memtrain.errors import UserError
from memtrain.model.attention import plain

# small widths under their generic names (a config's attribute_map gives each family's own: n_embd, d_model, ...)
SMALL = {"hidden_size": 64, "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "word_embed_proj_dim": 64,
         "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128}
CPU_ATTENTION = ("eager", "sdpa")
SAMPLES = (12, 20)  # two samples packed into one row: the second one is compared with itself alone
TOLERANCE = 1e-4  # fp32 logits of the same tokens: ~1e-7 apart where the samples are kept apart, ~0.5 where not


def small_copy(config):
    """The config with 2 layers and the widths of SMALL wherever it has them (a key it refuses keeps its value)."""
    small = copy.deepcopy(config)
    layers = min(2, config.num_hidden_layers)
    special = [i for key in ("bos_token_id", "eos_token_id", "pad_token_id")
               for i in (lambda v: v if isinstance(v, list) else [v])(getattr(config, key, None)) if isinstance(i, int)]
    values = {**SMALL, "vocab_size": max([SMALL["vocab_size"], *(i + 1 for i in special)]),  # its ids stay in range
              "num_hidden_layers": layers, "use_cache": False}  # with a cache transformers reads no packed positions
    if isinstance(getattr(config, "layer_types", None), list):
        values["layer_types"] = config.layer_types[:layers]
    for key, value in values.items():
        if getattr(small, key, None) is not None or key == "use_cache":
            try:
                setattr(small, key, value)
            except (AttributeError, TypeError, ValueError):  # a derived or validated key: the family's own value
                pass
    if getattr(config, "_attn_implementation", None) not in CPU_ATTENTION:  # a GPU kernel: the family's default
        small._attn_implementation = None
    return small


def mixes_samples(config) -> Optional[float]:
    """How far apart a packed sample's logits are from its own, relative to them (None: the small copy does not run
    here), with transformers' own attention functions (memtrain.model.attention.plain)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 transformers: heavy, imported only when this runs

    small = small_copy(config)
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, small.vocab_size, (1, n), generator=generator) for n in SAMPLES]
    positions = torch.cat([torch.arange(n) for n in SAMPLES])[None]
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
        with torch.no_grad(), plain(), torch.device("cpu"):
            packed = model(input_ids=torch.cat(ids, 1), position_ids=positions).logits[0, SAMPLES[0]:]
            alone = model(input_ids=ids[1], position_ids=positions[:, SAMPLES[0]:]).logits[0]
    except Exception:  # noqa: BLE001 any family's own error: this check then cannot tell, and the run goes on
        return None
    return float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-30))


def check(config, data_format: str) -> None:
    """UserError (one line) where the model lets a packed sample attend to the samples before it."""
    apart = mixes_samples(config)
    if apart is not None and apart > TOLERANCE:
        name = (getattr(config, "architectures", None) or [type(config).__name__.replace("Config", "ForCausalLM")])[0]
        raise UserError(f"data.format: '{data_format}' packs whole samples into rows with positions restarting per "
                        f"sample, and {name} ({config.model_type}) does not keep them apart: its attention mask ignores "
                        f"the position ids, so a sample would attend to the samples packed before it (a 2-layer copy's "
                        f"logits of a packed sample differ from its own by {apart:.0%}); use data.format text or a "
                        "model whose attention reads packed positions (Llama, Qwen, Mistral, Gemma, GPT-2, ...)")

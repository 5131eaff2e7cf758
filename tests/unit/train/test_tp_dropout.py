"""Dropout under AutoTP (memtrain.train.rng): the ranks of a tensor-parallel group draw the same masks on replicated
activations and their own masks on their shards of the attention heads, through recompute and resume.

Two launches of the real `deepspeed` launcher with 2 gloo ranks (tests/tp_dropout_worker.py): every check and a
2-step trainer run, then the trainer resumed from that run's step-1 model checkpoint. References are independent
of the code under test: a plain single-process copy of the weights seeded with torch.manual_seed, no-recompute
gradients, the other rank's numbers. One line for what cannot be placed is checked in-process (the preflight).
"""
import json

import pytest

from conftest import ROOT
from families import FAMILIES

# biogpt (not in tests/families.py: a decoder whose MLP has its own dropout, activation_dropout, which AutoTP takes)
TINY = {**FAMILIES, "biogpt": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "max_position_embeddings": 256}}


# --------------------------------------------------------------------------- what cannot be placed: one line

@pytest.mark.parametrize("family, refused, accepted, expected", [
    ("biogpt", {"activation_dropout": 0.1}, {"activation_dropout": 0.0, "attention_probs_dropout_prob": 0.1},
     "the model's activation_dropout (0.1) drops out the MLP's inner width"),
    ("starcoder2", {"attention_dropout": 0.1, "residual_dropout": 0.1}, {"attention_dropout": 0.1},
     "Starcoder2Attention drops out its replicated output (residual_dropout) as well as its sharded heads'"),
])
def test_dropout_autotp_cannot_place_is_one_line(family, refused, accepted, expected):
    """OPT's MLP dropout (activation_dropout) is gone from transformers 5; BioGPT keeps one. Before any worker (the
    preflight, in-process); the neighbouring configuration passes."""
    import re

    from memtrain.config.args import parse_args
    from memtrain.errors import UserError
    from memtrain.train.preflight import resolve_run

    def argv(extra: dict) -> list:
        return ["--deepspeed", str(ROOT / "ds_configs" / "zero3_tp2_ckpt.json"),
                "--set", f"model.type={family}", "--set", f"model.config={json.dumps({**TINY[family], **extra})}",
                "--set", "data.random_tokens=true"]

    with pytest.raises(UserError, match=re.escape(expected)):
        resolve_run(parse_args(argv(refused)), 2)
    resolve_run(parse_args(argv(accepted)), 2)

"""Tensor parallelism (DeepSpeed AutoTP), partitioned activation checkpoints and ZeRO-3 initialisation.

One launch of the real `deepspeed` launcher with 2 gloo ranks runs every distributed check
(tests/tp_worker.py); the tests below assert on what it measured. References are independent of the
code under test: a single-process plain-torch TP=1 model (clipped like DeepSpeed), a plain
transformers build from the same seed, the analytic size of a hidden state, and a walk of the
autograd graph for what DeepSpeed's checkpoints keep. Bad `autotp_size` values are checked in-process
(the preflight), plus one real subprocess for the one-line message.
"""
import json
import sys

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest

from conftest import ROOT
from memtrain.train import preflight

DS = ROOT / "ds_configs" / "zero3_ckpt.json"


# --------------------------------------------------------------------------- bad autotp_size: one line

def _ds(tmp_path, tensor_parallel):
    cfg = json.loads(DS.read_text())
    cfg["tensor_parallel"] = tensor_parallel
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("tensor_parallel, world, sets, expected", [
    ({"autotp_size": 3}, 2, [], "tensor_parallel.autotp_size: 3 does not divide the world size 2"),
    ({"autotp_size": 8}, 8, [], "tensor_parallel.autotp_size: 8 does not divide the model's num_attention_heads 4"),
    ({"autotp_size": 4}, 4, ["model.config.num_key_value_heads=2"],
     "tensor_parallel.autotp_size: 4 does not divide the model's num_key_value_heads 2"),
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, 2, [], "tensor_parallel.tp.tp_size: 4 differs from"),
    ({"autotp_size": "two"}, 2, [], "tensor_parallel.autotp_size: expected an integer >= 0, got \"two\""),
    ({"autotp_size": 2, "tp_sise": 1}, 2, [], "tensor_parallel.tp_sise"),
])
def test_bad_autotp_size_is_one_line(tmp_path, capsys, tensor_parallel, world, sets, expected):
    argv = ["--world-size", str(world), "--deepspeed", _ds(tmp_path, tensor_parallel),
            *[a for s in sets for a in ("--set", s)]]
    with pytest.raises(SystemExit) as exc:
        preflight.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memtrain: error: ") and expected in err[0], err


def test_tensor_parallel_groups_across_nodes_warn(tmp_path, monkeypatch):
    """4 ranks as 2 nodes of 2 (each worker's LOCAL_WORLD_SIZE): AutoTP 4's group spans both: a warning line; on one
    node of 4 none."""
    from memtrain.config.args import parse_args

    args = parse_args(["--deepspeed", _ds(tmp_path, {"autotp_size": 4})])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    spans = [w for w in preflight.resolve_run(args, 4).warnings if "span nodes" in w]
    assert spans == [f"{tmp_path / 'ds.json'}: tensor_parallel.autotp_size 4: its groups of 4 consecutive ranks span "
                     "nodes (2 rank(s) per node), so each layer's all-reduces cross the inter-node network; use a size "
                     "that divides the ranks per node"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launch.py sets this one, not LOCAL_WORLD_SIZE
    assert [w for w in preflight.resolve_run(args, 4).warnings if "span nodes" in w] == spans
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not [w for w in preflight.resolve_run(args, 4).warnings if "span nodes" in w]


def test_unsharded_model_is_one_line():
    """What DeepSpeed's AutoTP could not shard (an architecture it does not know) stops the run, never
    trains unsharded; checked on a model AutoTP never saw (in-process: the check reads module types)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tp_worker

    from memtrain.errors import UserError
    from memtrain.model.build import build_model
    from memtrain.train.parallel import check_sharded

    model = build_model(tp_worker.SECTION, tp_worker.CONFIG)
    check_sharded(model, 1)
    with pytest.raises(UserError, match="AutoTP sharded no layer of LlamaForCausalLM"):
        check_sharded(model, 2)

"""The step-time model's per-call overhead re-counts a recomputed layer's calls (`step_time.RECOMPUTE_CALLS`):
checked against the aten ops a real CPU step dispatches under each plan, counted here. In process, seconds."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.config.recipe import load_recipe
from memtrain.memory.step_time import layer_calls
from memtrain.model.build import build_config, build_model
from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import plan_for


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _step_ops(layers: int, policy: str) -> int:
    """aten ops of one forward and backward of the tiny Llama with `policy` (torch's checkpoint), after a warm-up."""
    recipe = load_recipe(None, [f"model.config.num_hidden_layers={layers}"])
    torch.manual_seed(0)
    model = build_model(recipe.model, build_config(recipe.model, vocab_size=257, seq_len=32)).train()
    apply_plan(model, plan_for(policy, layers, backend="torch"))
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    with _Ops() as ops:
        model(input_ids=ids, labels=ids).loss.backward()
    return ops.count


def test_op_recompute_reruns_as_many_calls_as_full():
    """Op-level recompute saves the matmuls but runs the layer's whole forward again, as full recompute does
    (measured 2026-11-27: 0.61 and 0.60 of a layer's forward-and-backward ops). The model's extra calls of op over
    full's follow that count within 10%."""
    keep4, keep2 = _step_ops(4, "none"), _step_ops(2, "none")
    per_layer = (keep4 - keep2) / 2  # a decoder layer's forward-and-backward ops, no recompute
    measured = {p: (_step_ops(4, p) - keep4) / (4 * per_layer) for p in ("full", "op")}
    ratio = measured["op"] / measured["full"]
    assert 0.9 < ratio < 1.1, measured
    model = (layer_calls(("op",)) - 1.0) / (layer_calls(("full",)) - 1.0)
    assert abs(model - ratio) <= 0.1, (model, measured)

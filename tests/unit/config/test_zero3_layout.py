"""Recompute under ZeRO-3 runs no ZeRO-3 hook: counted from DeepSpeed's own coordinator and collectives on 2 gloo
ranks (one launch of tests/zero3_worker.py, the trainer's engine set-up), with gradients unchanged."""




# --------------------------------------------------------------------------- the decision itself (no launch)

def _layout(zero: dict, dp: int = 1, segments: bool = False):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from memtrain.config.zero3 import zero3_layout

    return zero3_layout({"zero_optimization": {"stage": 3, **zero}}, LlamaDecoderLayer, 45_056, dp, segments)


def test_layout_makes_layers_leaf_modules_unless_the_json_decides():
    qualified = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    cfg = _layout({}, dp=2).apply({"zero_optimization": {"stage": 3, "overlap_comm": True}})
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": True, "leaf_module": {"classes": [qualified]}}
    for zero, named in [({"leaf_module": {"classes": []}}, "zero_optimization.leaf_module"),
                        ({"stage3_module_granularity_threshold": 5000},
                         "zero_optimization.stage3_module_granularity_threshold (5000)")]:
        layout = _layout(zero, dp=2)
        assert not layout.leaf_layers and f"the JSON's {named} decides" in layout.lines[0]
    segmented = _layout({}, dp=2, segments=True)
    assert not segmented.leaf_layers and "sqrt segments" in segmented.lines[0]
    from memtrain.config.zero3 import zero3_layout

    assert zero3_layout({"zero_optimization": {"stage": 2}}, object, 1, 1).lines == ()  # ZeRO-1/2: nothing to say


def test_layout_keeps_parameters_resident_only_where_nothing_is_sharded():
    one = _layout({})
    assert one.persistence_threshold == 45_056 and "nothing to shard" in one.lines[1]
    assert one.apply({"zero_optimization": {"stage3_param_persistence_threshold": 1e5}})["zero_optimization"][
        "stage3_param_persistence_threshold"] == 45_056
    assert _layout({}, dp=2).persistence_threshold == 0
    assert _layout({"offload_param": {"device": "cpu"}}).persistence_threshold == 0
    off = _layout({"stage3_param_persistence_threshold": 0})
    assert off.persistence_threshold == 0 and "residency: off" in off.lines[1]

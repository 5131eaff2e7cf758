"""Which DeepSpeed JSONs make the preflight wait on DeepSpeed's op-build locks (tests/launch/test_rank_imports.py
checks what a plain run imports)."""


def test_only_a_json_that_loads_a_deepspeed_op_waits_on_its_build_lock():
    """The preflight clears stale op-build locks (and imports torch.utils.cpp_extension for it) only where the
    engine loads one of DeepSpeed's ops: its Adam ops under offload or without torch_adam, any other optimizer."""
    from memtrain.config.ds_checks import loads_ops

    torch_adamw = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert not loads_ops(torch_adamw) and not loads_ops({})  # {}: memtrain's own torch AdamW
    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    for loads in ({"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}, {"optimizer": {"type": "Lion"}},
                  {**torch_adamw, **offload}, offload, {"zero_optimization": {"offload_param": {"device": "nvme"}}}):
        assert loads_ops(loads), loads

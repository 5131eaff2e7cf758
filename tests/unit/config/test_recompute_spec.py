"""The one RecomputeSpec: what each JSON key does on each device and layout, decided in one function that every
consumer reads (memtrain.config.recompute_spec)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from memtrain.config.recipe import ACSection
from memtrain.config.recompute_spec import resolve_recompute
from memtrain.errors import UserError

SRC = Path(__file__).resolve().parents[3] / "src" / "memtrain"


def _spec(keys: dict, device: str = "cuda", tp: int = 1, hooks_inside: bool = False, **section):
    return resolve_recompute({"activation_checkpointing": keys}, ACSection(**section), device, tp,
                             zero3_hooks_inside=hooks_inside)


@pytest.mark.parametrize("keys, device, tp, section, backend, partition, offload, impl", [
    ({}, "cuda", 1, {}, "torch", False, False, "memtrain"),
    # offload takes effect on a GPU only; partitioning needs a tensor-parallel group
    ({"cpu_checkpointing": True}, "cuda", 1, {}, "deepspeed", False, True, "memtrain"),
    ({"cpu_checkpointing": True}, "cpu", 1, {}, "torch", False, False, "memtrain"),
    ({"partition_activations": True}, "cuda", 1, {}, "torch", False, False, "memtrain"),
    ({"partition_activations": True}, "cuda", 2, {}, "deepspeed", True, False, "memtrain"),
    # with real partitioning DeepSpeed offloads each rank's shard itself
    ({"partition_activations": True, "cpu_checkpointing": True}, "cuda", 2, {}, "deepspeed", True, True, "deepspeed"),
    # a forced torch backend: partitioning cannot take effect (a warning says so), memtrain offloads
    ({"partition_activations": True, "cpu_checkpointing": True}, "cuda", 2, {"backend": "torch"}, "torch", False,
     True, "memtrain"),
    ({"cpu_checkpointing": True}, "cuda", 1, {"backend": "torch"}, "torch", False, True, "memtrain"),
])
def test_each_json_key_takes_effect_where_it_has_something_to_do(keys, device, tp, section, backend, partition,
                                                                  offload, impl):
    spec = _spec(keys, device, tp, **section)
    assert (spec.backend, spec.partition_activations, spec.cpu_checkpointing, spec.offload_impl) == \
        (backend, partition, offload, impl)
    noted = {n.partition(":")[0] for n in spec.notes}
    # a key asked for that has nothing to do here gets one plan line, and only then
    assert ("cpu_checkpointing" in noted) == (keys.get("cpu_checkpointing", False) and device != "cuda")
    assert ("partition_activations" in noted) == (keys.get("partition_activations", False) and tp == 1)
    kwargs = spec.deepspeed_kwargs(4)  # what DeepSpeed's checkpointing.configure receives
    assert kwargs["checkpoint_in_cpu"] == (impl == "deepspeed" and offload)  # never both memtrain and DeepSpeed
    assert kwargs["partition_activations"] == partition and kwargs["num_checkpoints"] == 4


def test_zero3_hooks_inside_a_recompute_take_deepspeeds_reentrant_checkpoint():
    assert _spec({}, hooks_inside=True).backend == "deepspeed"
    assert any(n.startswith("backend: DeepSpeed's reentrant checkpoint") for n in _spec({}, hooks_inside=True).notes)
    assert _spec({}, hooks_inside=True, policy="none").backend == "torch"  # nothing recomputed
    op = _spec({}, hooks_inside=True, policy="op")  # op-level needs torch's checkpoint: kept, with a warning
    assert op.backend == "torch" and any("FWD_MODULE_STACK" in w for w in op.warnings)
    assert _spec({}, hooks_inside=True, backend="torch").backend == "torch"


def test_impossible_combinations_are_one_line():
    with pytest.raises(UserError, match="cpu_checkpointing_impl: 'deepspeed' offloads inside DeepSpeed's"):
        _spec({"cpu_checkpointing": True}, backend="torch", cpu_checkpointing_impl="deepspeed")
    with pytest.raises(UserError, match="op-level.*backend is 'deepspeed'"):
        _spec({}, policy="op", backend="deepspeed")
    with pytest.raises(UserError, match="needs an activation_checkpointing section"):
        resolve_recompute({}, ACSection(policy="full"), "cuda")
    assert resolve_recompute({}, ACSection(), "cuda").policy == "none"  # no section, no explicit policy: off


def test_keys_only_deepspeeds_checkpoint_honours_are_named_under_torch():
    spec = _spec({"profile": True, "synchronize_checkpoint_boundary": True})
    assert spec.backend == "torch" and spec.ignored_by_torch == ("profile", "synchronize_checkpoint_boundary")
    assert _spec({"profile": True}, backend="deepspeed").ignored_by_torch == ()


def test_only_the_spec_reads_the_jsons_activation_checkpointing_section():
    """The decision lives in one function: no other module reads the section through ac_section or
    re-derives what partition_activations / cpu_checkpointing do."""
    readers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if re.search(r"\b(ac_section|_json_section|json_effects|resolve_backend)\(", p.read_text())
                     and p.name != "recompute_spec.py")
    assert readers == []

"""Activation profiles kept on disk (memtrain.memory.profile_cache): a kept one equals a fresh measurement, is read
instead of measured, and any changed input (config, target, versions) or a damaged entry is measured again.
The 2-rank side (the ranks read what make train's preflight measured) is in tests/test_resume.py."""
import copy
from dataclasses import replace

import pytest

from conftest import SMALL_LLAMA
from memtrain.config.recipe import LoraSection, ModelSection
from memtrain.memory import profile_cache
from memtrain.memory.profile import forget_measured, profile_activations
from memtrain.memory.target import Target
from memtrain.model.build import build_config

MODES = ("keep",)  # one mode (a key of its own): the cheapest measurement, and the key does not depend on how many


def _entries(folder):
    """Each kept entry's name, inode and modification time: a measurement writes a new file (renamed into place)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("*.json")}


@pytest.fixture
def kept(tmp_path):
    forget_measured()
    profile_cache.keep_in(tmp_path)
    yield tmp_path
    profile_cache.keep_in(None)
    forget_measured()


def test_a_kept_profile_is_read_and_a_changed_input_is_measured_again(kept, monkeypatch):
    config = build_config(ModelSection(type="llama", config=SMALL_LLAMA), vocab_size=257, seq_len=32)
    target = Target("cpu", "float32", 2, 32, 2)
    profile_cache.keep_in(None)
    measured = profile_activations(config, target, MODES)  # the reference: measured here, nothing kept
    profile_cache.keep_in(kept)

    assert profile_activations(config, target, MODES) == measured  # kept (this process's measurement)
    first = _entries(kept)
    assert len(first) == 1
    forget_measured()  # a new process (a rank): read, equal, and not measured again (the entry is untouched)
    assert profile_activations(config, target, MODES) == measured and _entries(kept) == first

    wider = copy.deepcopy(config)
    wider.intermediate_size = 192
    for other_config, other_target in ((wider, target), (config, replace(target, seq_len=16)),
                                       (config, replace(target, world_size=4, micro_batch_size=1)),
                                       (config, replace(target, lora=LoraSection(r=4)))):
        forget_measured()
        profile_cache.keep_in(None)
        fresh = profile_activations(other_config, other_target, MODES)  # measured once, held in this process's memo
        profile_cache.keep_in(kept)
        before = _entries(kept)
        # a new entry, of this input's measurement: an entry kept under a key that missed the change would be read
        # instead, and it holds `measured`'s costs
        assert profile_activations(other_config, other_target, MODES) == fresh
        assert len(_entries(kept)) == len(before) + 1 and all(_entries(kept)[n] == v for n, v in before.items())

    before = _entries(kept)
    monkeypatch.setattr(profile_cache, "versions", lambda: ("another torch",))  # an upgrade: a new key
    assert profile_activations(config, target, MODES) == measured and len(_entries(kept)) == len(before) + 1
    monkeypatch.undo()

    (kept / next(iter(first))).write_text('{"key": "')  # a damaged entry: measured again and rewritten whole
    forget_measured()
    assert profile_activations(config, target, MODES) == measured
    assert _entries(kept)[next(iter(first))] != first[next(iter(first))]


def test_the_fused_loss_backend_is_part_of_the_memo_key(kept, monkeypatch):
    """torch's linear_cross_entropy and memtrain.model.chunked_ce (torch < 2.13) keep different working sets in
    bf16: a profile measured with one is never handed out for the other, from this process's memo or from disk.
    Each is compared with a fresh measurement (memos emptied first, nothing kept)."""
    import torch

    config = build_config(ModelSection(type="llama", config=SMALL_LLAMA), vocab_size=300, seq_len=64)
    target = Target("cpu", "bfloat16", 2, 64, 2, loss="fused")
    profile_cache.keep_in(None)
    with_torch = profile_activations(config, target, ("keep",))
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")  # torch < 2.13: memtrain's chunked loss
    forget_measured()
    chunked_fresh = profile_activations(config, target, ("keep",))
    assert chunked_fresh != with_torch  # the two backends measure apart at this shape
    monkeypatch.undo()
    forget_measured()
    assert profile_activations(config, target, ("keep",)) == with_torch
    monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy")
    assert profile_activations(config, target, ("keep",)) == chunked_fresh  # not the torch one memoized above

    profile_cache.keep_in(kept)  # on disk: the chunked one kept, then read by torch's backend in a new process
    forget_measured()
    assert profile_activations(config, target, ("keep",)) == chunked_fresh
    monkeypatch.undo()
    forget_measured()
    assert profile_activations(config, target, ("keep",)) == with_torch and len(_entries(kept)) == 2


def test_what_no_measurement_reads_shares_one_measurement(monkeypatch):
    """Targets that differ only in the world size, the trained share and the accumulation steps measure the same
    bytes (each measured afresh here, memos emptied), so this process measures them once: the second is handed the
    first's costs under its own target, with no measurement on fake tensors."""
    from memtrain.memory import profile

    config = build_config(ModelSection(type="llama", config=SMALL_LLAMA), vocab_size=257, seq_len=32)
    small = Target("cpu", "float32", 2, 32, 2)
    large = replace(small, world_size=16, grad_accum=4, trainable_params=5, all_params=10)
    forget_measured()
    fresh_large = profile_activations(config, large, MODES)
    forget_measured()
    fresh_small = profile_activations(config, small, MODES)
    assert fresh_large.target == large and replace(fresh_large, target=small) == fresh_small
    measured = []
    real = profile._measure_profile
    monkeypatch.setattr(profile, "_measure_profile", lambda *a, **k: measured.append(a) or real(*a, **k))
    assert profile_activations(config, large, MODES) == fresh_large and not measured
    forget_measured()


FLOP_FIELDS = ("fwd_flops", "bwd_flops", "recompute_flops")


def test_a_memory_only_profile_gives_the_same_max_seq_figures():
    """`make plan --max-seq` measures without torch's FLOP counter (`count_flops=False`: about 40% of a measurement's
    time). On both losses x tiled MLP off, 2 and 4 slices: every field but the FLOPs equals the full measurement's, and
    so does each of --max-seq's policies' predicted peak, peak phase and host bytes (predict reads no FLOPs)."""
    import json

    from conftest import ROOT
    from memtrain.memory.predict import LayerChoice, predict
    from memtrain.memory.states import model_states
    from memtrain.recompute.policy import FULL, KEEP

    ds = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    config = build_config(ModelSection(type="llama", config={**SMALL_LLAMA, "max_position_embeddings": 256}),
                          vocab_size=257, seq_len=256)
    policies = [LayerChoice(KEEP), LayerChoice(FULL), LayerChoice(FULL, offload=True)]
    for loss, tiled, seq in (("standard", 0, 128), ("fused", "auto", 128), ("standard", "auto", 256)):
        target = replace(Target("cpu", "float32", 1, seq, 2), loss=loss, tiled_mlp=tiled)
        cheap, full = (profile_activations(config, target, ("keep", "full"), count_flops=c) for c in (False, True))
        for mode, cost in full.layers.items():
            assert cost.fwd_flops > 0 and cost.bwd_flops > 0  # the full measurement counts FLOPs
            assert all(getattr(cheap.layers[mode], f) == 0 for f in FLOP_FIELDS)
            assert replace(cheap.layers[mode], **{f: getattr(cost, f) for f in FLOP_FIELDS}) == cost, (mode, loss, tiled)
        assert replace(cheap, layers=full.layers) == full, (loss, tiled)
        states = model_states(full, ds, target)
        for choice in policies:
            ours, theirs = (predict(p, states, (choice,) * p.num_layers) for p in (cheap, full))
            assert (ours.peak, ours.phase, ours.host_activations) == (theirs.peak, theirs.phase, theirs.host_activations)


def test_a_memory_only_request_after_a_counted_measurement_measures_nothing(monkeypatch):
    """A prediction (memory only) after `make plan`'s or the auto plan's FLOP-counted measurement of the same input,
    measured layer modes and modules modes alike: handed the counted profile's bytes with every FLOP field 0, equal to
    a fresh memory-only measurement, and nothing measured on fake tensors again."""
    from memtrain.memory import profile
    from memtrain.memory.profile import modules_mode

    config = build_config(ModelSection(type="llama", config=SMALL_LLAMA), vocab_size=257, seq_len=32)
    target = Target("cpu", "float32", 2, 32, 2)
    modes = ("keep", modules_mode(["mlp"]))
    forget_measured()
    fresh = profile_activations(config, target, modes, count_flops=False)
    forget_measured()
    counted = profile_activations(config, target, modes)
    assert all(counted.layers[m].fwd_flops > 0 for m in modes)
    measured = []
    real = profile._run
    monkeypatch.setattr(profile, "_run", lambda *a, **k: measured.append(a) or real(*a, **k))
    assert profile_activations(config, target, modes, count_flops=False) == fresh and not measured
    forget_measured()


def test_a_process_that_misses_an_entry_another_is_measuring_waits_and_reads_it(kept, monkeypatch):
    """A node's ranks start together and miss the same entry: one measures, the others wait on its lock and read what
    it kept. Here the lock is held as another process would hold it (a flock on its own open file: the same conflict
    between two processes and between two opens in one), and a thread asks for the profile meanwhile: it measures
    nothing while the lock is held, and after it reads the entry written under the lock."""
    import threading

    import memtrain.memory.profile as profile

    config = build_config(ModelSection(type="llama", config=SMALL_LLAMA), vocab_size=257, seq_len=32)
    target = Target("cpu", "float32", 2, 32, 2)
    profile_cache.keep_in(None)
    reference = profile_activations(config, target, MODES)
    forget_measured()
    profile_cache.keep_in(kept)
    name = profile_cache.key(config.to_json_string(), {**target.to_dict(), "loss": profile._loss_code(target),
                                                       "flops": True}, MODES)
    measured = []
    real = profile._profiled
    monkeypatch.setattr(profile, "_profiled", lambda *a, **k: measured.append(a) or real(*a, **k))
    got = {}
    with profile_cache._measuring(name):  # the other rank, measuring
        asker = threading.Thread(target=lambda: got.update(profile=profile_activations(config, target, MODES)))
        asker.start()
        asker.join(timeout=1.0)
        assert asker.is_alive() and not measured  # waiting, not measuring the same profile beside it
        profile_cache.write(name, {**reference.to_dict(), "target": None})  # what the other rank kept
    asker.join(timeout=60)
    assert not asker.is_alive() and got["profile"] == reference and not measured  # read, not measured again

    forget_measured()
    (kept / f"{name}.json").unlink()  # nobody holds the lock: measured and kept at once
    assert profile_activations(config, target, MODES) == reference and len(measured) == 1
    assert (kept / f"{name}.json").exists()

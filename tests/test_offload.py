"""memtrain's offload of checkpointed activations (cpu_checkpointing), on CPU.

In-process tests run the real scheduling code (slots, prefetch, pool) with two copy engines:
the CPU one the trainer uses (plain copies), and `DeferredCopies`, which behaves like CUDA's
side stream (copies run later, in order, only once waited for), so a missing wait or a buffer
recycled too early shows up as wrong numbers. One launch checks the real ZeRO-3 path.
"""
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from conftest import FAST, ROOT, SMALL_LLAMA, assert_ok, run_train, sitecustomize_env
from memtrain.recompute.hooks import apply_plan, checkpoint_function
from memtrain.recompute.policy import plan_for
from memtrain.errors import UserError
from memtrain.recompute.meter import ActivationMeter
from memtrain.model.build import build_config, build_model, decoder_layers
from memtrain.recompute.offload import ActivationOffloader, HostBufferPool, offload_flags, offload_units
from memtrain.config.recipe import DEFAULT_OP_SAVE, ModelSection
from memtrain.recompute.compiled import CompiledLayers
from memtrain.tools.tb import read_scalars

LLAMA = SMALL_LLAMA
OFFLOAD_JSON = {"activation_checkpointing": {"cpu_checkpointing": True}}


class DeferredCopies:
    """A CPU stand-in for one CUDA copy stream: copies queue up and run in order only when the
    compute side waits for an event recorded after them. Until then destinations hold NaN (and
    fresh host buffers 0xFF bytes, NaN too), so reading too early gives wrong gradients."""

    def __init__(self):
        self.queue, self.done = [], 0

    def host_buffer(self, nbytes):
        return torch.full((nbytes,), 255, dtype=torch.uint8)

    def to_host(self, src, dst):
        self.queue.append((dst, src.detach()))  # keeps src's storage, as record_stream does

    def to_device(self, src):
        dst = torch.full(src.shape, float("nan"), dtype=src.dtype)
        self.queue.append((dst, src))
        return dst, len(self.queue)

    def wait(self, tensor, ready):
        while self.done < ready:
            dst, src = self.queue[self.done]
            dst.copy_(src)
            self.done += 1


@pytest.fixture(scope="module")
def base(small_llama):
    return small_llama


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


def _plan(backend, cpu_checkpointing, skip_last=1, policy="full", num_layers=LLAMA["num_hidden_layers"], **section):
    ds = {"activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing}}
    return plan_for(policy, num_layers, ds_config=ds, backend=backend, offload_skip_last=skip_last, **section)


def _steps(model, ids, steps, deferred=False, after_forward=None):
    """Train-like steps (forward under the meter, backward); per step: grads, meter bytes, and
    which layer inputs were still alive after the forward (`after_forward()` runs there too)."""
    if deferred:
        model.ac_offloader.copies = DeferredCopies()
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
             for layer in decoder_layers(model)[1]]
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        meter = ActivationMeter()
        inputs.clear()
        with meter.measure():
            loss = model(input_ids=ids, labels=ids).loss
        alive = [r() is not None for r in inputs]
        if after_forward is not None:
            after_forward()
        loss.backward()
        out.append(({n: p.grad.clone() for n, p in model.named_parameters()}, meter.bytes, meter.offloaded_bytes,
                    alive))
    for h in hooks:
        h.remove()
    return out


@pytest.fixture(scope="module")
def reference(base, ids):
    """Same plan, inputs kept on the device."""
    model = copy.deepcopy(base)
    apply_plan(model, _plan("torch", False))
    assert model.ac_offloader is None
    return _steps(model, ids, 1)[0]


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu-copies", "deferred-copies"])
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_grads_equal_pool_reused_memory_moves_to_host(base, ids, reference, backend, deferred):
    model = copy.deepcopy(base)
    plan = _plan(backend, True)
    assert plan.offload == (True, True, True, False) and plan.memtrain_offload
    apply_plan(model, plan)
    off = model.ac_offloader
    ref_grads, ref_bytes, _, ref_alive = reference
    assert ref_alive == [True] * 4  # kept on the device, each checkpoint holds its layer's input
    pools = []
    for step, (grads, device_bytes, host_bytes, alive) in enumerate(_steps(model, ids, 2, deferred)):
        for name, g in grads.items():
            assert torch.equal(g, ref_grads[name]), f"step {step}: {name}"
        # three layer inputs of 2x32x64 float32 left the device for host memory, nothing else did
        assert host_bytes == 3 * 2 * 32 * 64 * 4
        assert device_bytes + host_bytes == ref_bytes
        assert alive == [False, False, False, True]  # offloaded inputs are freed, not just copied
        assert off.live_bytes == 0  # every buffer is back in the pool after the backward
        pools.append((off.pool.allocations, off.pool.capacity_bytes))
    assert pools[0] == pools[1] == (3, host_bytes), pools  # allocated in step 1 only, then reused
    assert off.offloaded == 6 and off.prefetch_misses == 0  # all copied back before the backward got there


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_compiled_layers_offload_their_inputs_and_nothing_else(base, ids, reference, backend):
    """train.compile: a compiled layer saves more with autograd than an eager checkpoint (what its compiled backward
    reads); only its inputs go to host, as eager, and come back in time (copies deferred until waited on)."""
    model = copy.deepcopy(base)
    apply_plan(model, _plan(backend, True), CompiledLayers(DEFAULT_OP_SAVE))
    ref_grads, ref_bytes, _, _ = reference
    for grads, device_bytes, host_bytes, alive in _steps(model, ids, 2, deferred=True):
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
        assert host_bytes == 3 * 2 * 32 * 64 * 4  # three layer inputs of 2x32x64 float32
        assert alive == [False, False, False, True]
        assert abs(device_bytes + host_bytes - ref_bytes) <= 0.05 * ref_bytes
    assert model.ac_offloader.prefetch_misses == 0 and model.ac_offloader.live_bytes == 0


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_offloaded_tensors_come_back_bit_exact(backend):
    """Each offloaded input (dtypes, a non-contiguous one) reaches the recompute bit for bit."""
    plan = plan_for("full", 3, ds_config=OFFLOAD_JSON, backend=backend, offload_skip_last=0)
    off = ActivationOffloader(prefetch_depth=1)
    off.copies = DeferredCopies()
    inputs = [torch.randn(5, 7, dtype=torch.float32),
              torch.randn(6, 4, dtype=torch.bfloat16),
              torch.randn(8, 3, dtype=torch.float16).t()]  # non-contiguous
    seen = [[] for _ in inputs]
    x = torch.zeros((), requires_grad=True)
    out = x
    for i, t in enumerate(inputs):
        def layer(h, i=i):
            seen[i].append(h.detach().clone())
            return (h.float() ** 2).sum()  # pow saves h: the backward recomputes
        fn = checkpoint_function(plan, i, off)
        out = out + fn(layer, t + x)
    assert off.live_bytes == sum(t.numel() * t.element_size() for t in inputs)
    out.backward()
    for t, (forward, recompute) in zip(inputs, seen):
        assert recompute.dtype == t.dtype and recompute.shape == t.shape
        assert torch.equal(recompute.view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
    assert off.prefetch_misses == 1  # skip_last=0: the first layer the backward meets had no warning
    assert off.live_bytes == 0


def test_graph_dropped_without_backward_returns_buffers(base, ids):
    model = copy.deepcopy(base)
    apply_plan(model, _plan("torch", True))
    loss = model(input_ids=ids, labels=ids).loss
    off = model.ac_offloader
    assert off.live_bytes > 0
    del loss
    assert off.live_bytes == 0
    allocations = off.pool.allocations
    model(input_ids=ids, labels=ids).loss.backward()
    assert off.pool.allocations == allocations


def test_pool_best_fit():
    made = []
    pool = HostBufferPool(lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    a, b = pool.acquire(100), pool.acquire(300)
    pool.release(a)
    pool.release(b)
    assert pool.acquire(160).numel() == 300  # 100 is too small, 300 wastes less than half
    assert pool.acquire(40).numel() == 40  # 100 would waste more than half: a new buffer
    assert made == [100, 300, 40] and pool.capacity_bytes == 440


def test_plan_flags_and_description():
    assert offload_flags([True, False, True, True], True, 1) == (True, False, True, False)
    assert offload_flags([True, True], True, 5) == (False, False)
    assert offload_flags([True, True], False, 0) == (False, False)
    assert offload_flags([True, False, True], True, 1, every=True) == (True, False, True)
    # a segment is one unit: its head's call is the only one that keeps an input
    assert offload_units([True] * 6, ((0, 3), (3, 5))) == (0, 3, 5)
    assert offload_flags([True] * 6, True, 1, segments=((0, 3), (3, 5))) == (True, False, False, True, False, False)
    assert offload_flags([True] * 6, True, 1, every=True, segments=((0, 3), (3, 6))) == (True, False, False,
                                                                                            True, False, False)
    plan = _plan("deepspeed", True, skip_last=2)
    assert plan.offload == (True, True, False, False)
    assert ("memtrain offload: inputs of 2 of 4 recomputed layers (layers 0,1) go to host memory; the last 2 stay "
            "on the device") in plan.describe()
    assert "DeepSpeed's own CPU_CHECKPOINT off" in plan.describe()
    assert "H H D D" in plan.describe()
    # sqrt over 16 layers: 4 segments of 4; the last segment's head (not the last layer, a follower) stays
    sqrt = _plan("torch", True, policy="sqrt", num_layers=16)
    assert sqrt.segments == ((0, 4), (4, 8), (8, 12), (12, 16))
    assert [i for i, f in enumerate(sqrt.offload) if f] == [0, 4, 8]
    assert ("inputs of 3 of 4 segments (heads of layers 0,4,8) go to host memory; the last 1 stays on the device"
            in sqrt.describe())
    assert "[H - - -] [H - - -] [H - - -] [D - - -]" in sqrt.describe()
    # 5 layers: segments 0-1, 2-3 and layer 4 on its own: three units
    mixed = _plan("torch", True, skip_last=2, policy="sqrt", num_layers=5)
    assert mixed.segments == ((0, 2), (2, 4)) and mixed.offload == (True, False, False, False, False)
    assert "inputs of 1 of 3 checkpointed units (segments at layers 0) go to host memory; the last 2 stay" \
        in mixed.describe()
    assert "[H -] [D -] D" in mixed.describe()
    every = _plan("torch", True, policy="every:2", num_layers=6)
    assert "inputs of 2 of 3 recomputed layers (layers 0,2) go to host memory; the last 1 stays" in every.describe()
    assert "H . H . D ." in every.describe()
    assert "all 4 stay on the device" in _plan("torch", True, skip_last=4).describe()
    modules = _plan("torch", True, policy="modules", modules=["model.layers.*.mlp"])
    assert modules.memtrain_offload and not any(modules.offload)
    assert ("inputs of the modules matching model.layers.*.mlp go to host memory, but the last 1 in module order, "
            "which stays on the device") in modules.describe()
    ds_own = plan_for("full", 4, ds_config=OFFLOAD_JSON, backend="deepspeed", cpu_checkpointing_impl="deepspeed")
    assert not ds_own.memtrain_offload and "DeepSpeed's own CPU_CHECKPOINT copies" in ds_own.describe()
    assert "cpu_checkpointing: off" in _plan("torch", False).describe()
    with pytest.raises(UserError, match="activation_checkpointing.cpu_checkpointing_impl"):
        plan_for("full", 4, ds_config=OFFLOAD_JSON, backend="torch", cpu_checkpointing_impl="deepspeed")


HIDDEN_BYTES = 2 * 32 * 64 * 4  # one layer input of `ids`: micro-batch 2 x seq 32 x hidden 64, float32


@pytest.fixture(scope="module")
def base9():
    section = ModelSection(type="llama", config={**LLAMA, "num_hidden_layers": 9})
    config = build_config(section, vocab_size=257, seq_len=32)
    torch.manual_seed(0)
    return build_model(section, config).train()


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_sqrt_offloads_every_segment_head_but_the_last(base9, ids, backend):
    """sqrt over 9 layers: segments 0-2, 3-5, 6-8, each one checkpoint call keeping one input (its
    head's). offload_skip_last: 1 keeps the last segment's input (layer 6's) on the device, not
    the last layer's (8, a follower that keeps nothing): two inputs go to host, as described."""
    reference = copy.deepcopy(base9)
    apply_plan(reference, _plan(backend, False, policy="sqrt", num_layers=9))
    ref_grads, ref_bytes, _, _ = _steps(reference, ids, 1)[0]

    plan = _plan(backend, True, policy="sqrt", num_layers=9)
    assert plan.segments == ((0, 3), (3, 6), (6, 9)) and plan.offload_units == (0, 3, 6)
    found = re.search(r"inputs of (\d+) of (\d+) segments \(heads of layers ([\d,]+)\) go to host memory; "
                      r"the last (\d+) stays on the device", plan.describe())
    assert found, plan.describe()
    n_host, n_units, heads, n_kept = int(found[1]), int(found[2]), [int(i) for i in found[3].split(",")], int(found[4])
    assert (n_host, n_units, heads, n_kept) == (2, 3, [0, 3], 1)
    model = copy.deepcopy(base9)
    apply_plan(model, plan)
    off = model.ac_offloader
    off.copies = DeferredCopies()
    calls = []  # (layer, its input) per layer call from the model's loop or inside a segment
    for i, layer in enumerate(decoder_layers(model)[1]):
        layer.register_forward_pre_hook(lambda m, args, i=i: calls.append((i, weakref.ref(args[0]))))
    for step in range(2):
        calls.clear()
        alive = {}
        (grads, device_bytes, host_bytes, _), = _steps(
            model, ids, 1, after_forward=lambda: alive.update(
                {i: ref() is not None for i, ref in reversed(calls)}))  # each layer's first call: the loop's
        for name, g in grads.items():
            assert torch.equal(g, ref_grads[name]), f"step {step}: {name}"
        # measured: the described number of segment inputs left the device, nothing else did
        assert host_bytes == n_host * HIDDEN_BYTES
        assert device_bytes + host_bytes == ref_bytes
        # which ones: the described heads' inputs were freed after the forward, the last head's was
        # not. The model's loop calls every layer; a segment's last layer runs the others inside its call
        # (the forward), and the backward's recompute runs them again, last segment first
        assert [i for i, _ in calls] == [0, 1, 2, 0, 1, 3, 4, 5, 3, 4, 6, 7, 8, 6, 7] + [6, 7, 3, 4, 0, 1]
        assert [i for i in plan.offload_units if alive[i]] == [6]
        assert off.live_bytes == 0
    assert off.offloaded == 2 * n_host and off.prefetch_misses == 0


@pytest.mark.parametrize("policy", ["modules", "selective:mlp"])
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_mlp_units_offload_all_but_the_last(base, ids, backend, policy):
    """Each matched module (policy modules) or recomputed sublayer (selective:mlp) is one unit; with
    offload_skip_last: 1 the inputs of the MLPs of layers 0-2 leave the device, layer 3's stays."""
    section = {"modules": ["model.layers.*.mlp"]} if policy == "modules" else {}
    reference = copy.deepcopy(base)
    apply_plan(reference, _plan(backend, False, policy=policy, **section))
    ref_grads, ref_bytes, _, _ = _steps(reference, ids, 1)[0]
    model = copy.deepcopy(base)
    apply_plan(model, _plan(backend, True, policy=policy, **section))
    grads, device_bytes, host_bytes, _ = _steps(model, ids, 1)[0]
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert host_bytes == 3 * HIDDEN_BYTES and device_bytes + host_bytes == ref_bytes
    assert model.ac_offloader.offloaded == 3 and model.ac_offloader.live_bytes == 0


def _pool_bytes(pool):
    """What the pool holds, by its own accounting and by the buffers' storages."""
    storages = sum(b.untyped_storage().nbytes() for b in pool.cached_buffers())
    return pool.cached_bytes, storages


def test_pool_steady_state_allocates_nothing_and_shrinks_with_the_shapes(base):
    """Steps at seq 32, then seq 8: from the second seq-8 forward on, the pool holds exactly what a
    seq-8 step needs (the seq-32 buffers were not used in the step before and are dropped)."""
    model = copy.deepcopy(base)
    apply_plan(model, _plan("torch", True))
    large, small = (torch.randint(0, 257, (2, n), generator=torch.Generator().manual_seed(1)) for n in (32, 8))
    need_large, need_small = 3 * 2 * 32 * 64 * 4, 3 * 2 * 8 * 64 * 4  # 3 offloaded layer inputs per step
    _steps(model, large, 1)
    pool = model.ac_offloader.pool
    assert (pool.allocations, pool.capacity_bytes, pool.last_step_peak_bytes) == (3, need_large, 0)
    _steps(model, large, 4)  # steady state: nothing allocated, nothing dropped
    assert (pool.allocations, pool.frees, pool.capacity_bytes) == (3, 0, need_large)
    assert pool.last_step_peak_bytes == need_large and _pool_bytes(pool) == (need_large, need_large)

    _steps(model, small, 1)  # the seq-32 buffers are more than twice too big: three new ones
    assert pool.allocations == 6 and _pool_bytes(pool) == (need_large + need_small,) * 2
    _steps(model, small, 1)  # its forward ended the first seq-8 step: the seq-32 buffers went
    assert pool.frees == 3 and pool.last_step_peak_bytes == need_small
    assert pool.capacity_bytes == need_small and _pool_bytes(pool) == (need_small, need_small)
    _steps(model, small, 3)
    assert (pool.allocations, pool.frees) == (6, 3) and _pool_bytes(pool) == (need_small, need_small)

    # a shape within 2x reuses the buffers it fits (each wastes less than half): no allocation,
    # and the pool stays within twice what the step needs
    mid = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(1))
    _steps(model, mid, 3)
    assert (pool.allocations, pool.frees) == (6, 3) and pool.cached_bytes <= 2 * 3 * 2 * 6 * 64 * 4


def test_pool_drops_unused_buffers_and_caps_cached_bytes_at_the_step_peak():
    trims = []
    pool = HostBufferPool(lambda n: torch.empty(n, dtype=torch.uint8), trim=lambda: trims.append(1))
    a, b = pool.acquire(100), pool.acquire(300)
    pool.release(a)
    pool.release(b)
    assert pool.end_step() == 0 and pool.last_step_peak_bytes == 400 and not trims
    pool.release(pool.acquire(40))  # only a new 40-byte buffer is used in this step
    assert pool.cached_bytes == 440
    assert pool.end_step() == 400 and trims == [1]  # 100 and 300 were idle for a whole step
    assert [t.numel() for t in pool.cached_buffers()] == [40] and pool.capacity_bytes == pool.cached_bytes == 40
    # used one after the other, never together: the step's peak in use is 300, so 300 bytes stay cached
    pool.release(pool.acquire(40))
    pool.release(pool.acquire(300))
    assert pool.end_step() == 300 and pool.cached_bytes == 40 <= pool.last_step_peak_bytes == 300
    # a buffer still out at the step boundary is neither dropped nor forgotten
    held = pool.acquire(40)
    assert pool.end_step() == 0 and pool.in_use_bytes == 40
    pool.release(held)
    assert pool.end_step() == 0 and pool.cached_bytes == 40 and pool.allocations == 4


def test_zero3_two_ranks_with_cpu_checkpointing(tmp_path):
    """The real launcher, ZeRO-3, 2 CPU ranks, the default JSON (cpu_checkpointing and partition_activations
    on) with DeepSpeed's reentrant checkpoint: on a CPU run both keys are no-ops, each says why in the plan,
    and nothing is copied."""
    ds_path = ROOT / "ds_configs" / "zero3_ckpt.json"
    ac = json.loads(ds_path.read_text())["activation_checkpointing"]
    assert ac["cpu_checkpointing"] is True and ac["partition_activations"] is True
    run_dir = tmp_path / "run"
    proc = run_train(["--deepspeed", str(ds_path), "--run-dir", str(run_dir), "--max-steps", "6", *FAST,
                      "--set", "activation_checkpointing.backend=deepspeed"], nproc=2)
    assert_ok(proc)
    assert "cpu_checkpointing: a CPU run's activations are already in host memory: no copies, no cost" in proc.stdout
    assert "partition_activations: nothing to shard: no tensor-parallel group" in proc.stdout
    assert "with deepspeed.checkpointing.checkpoint (reentrant)" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ac_plan"]["offload"] == [False] * 4
    scalars = read_scalars(run_dir / "tb")
    assert "memory/offloaded_activation_gib" not in scalars  # logged only when memtrain offloads
    loss = [v for _, v in scalars["train/loss"]]
    assert len(loss) == 6 and loss[-1] < loss[0]


# --------------------------------------------------------------------------- the benchmark's pieces

def test_bench_runs_the_trainer_with_offload(tmp_path):
    """A bench set-up is the trainer itself (src/train.py) with bench settings: random tokens, no
    model checkpoint, figures from its summary.json; the plain baseline is its own process."""
    from memtrain.tools.bench.runner import Runner

    run = Runner(None, ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=2"],
                 str(ROOT / "ds_configs" / "zero3_ckpt.json"), steps=2, warmup=1, ngpus=1)
    result = run("memtrain:full+offload@torch")
    assert "error" not in result, result
    assert result["tokens_per_s"] > 0 and result["peak_gib"] is None  # CPU: no GPU peak
    assert result["plan"] == "RR" and result["world_size"] == 1
    assert result["offloaded_gib"] == 0  # a CPU run's activations are already in host memory: nothing to copy
    assert not list(run.tmp.glob("*/checkpoints"))  # bench settings: no model checkpoint written
    plain = run("torch:noac")
    assert "error" not in plain and plain["tokens_per_s"] > 0 and plain["world_size"] == 1


def test_bench_setup_names_with_zero3_flags():
    from memtrain.tools.bench.__main__ import GPU_CHECK_SETUPS
    from memtrain.tools.bench.setups import parse_setup

    s = parse_setup("memtrain:full+offload-leaf-resident")
    assert (s.ac, s.cpu_checkpointing, s.leaf, s.resident) == ("full", True, False, False)
    assert s.label == "trainer, policy 'full', memtrain offload, no leaf layers, not resident"
    s = parse_setup("memtrain:op@torch-leaf")
    assert (s.ac, s.backend, s.leaf, s.resident) == ("op", "torch", False, True)
    for name in GPU_CHECK_SETUPS:
        parse_setup(name)  # every gpu-check set-up parses


def test_bench_setups_search_and_table():
    from memtrain.tools.bench.__main__ import double_until_oom
    from memtrain.tools.bench.setups import parse_setup
    from memtrain.tools.bench.table import markdown, targets

    s = parse_setup("memtrain:op+first:4+offload@torch")
    assert (s.trainer, s.ac, s.backend, s.cpu_checkpointing, s.impl) == (True, "op+first:4", "torch", True, "memtrain")
    assert parse_setup("deepspeed:cpu-ckpt").impl == "deepspeed" and not parse_setup("torch:sac").trainer
    assert parse_setup("memtrain:full").backend == "auto"
    with pytest.raises(UserError, match="--setups"):
        parse_setup("memtrain:full@jax")

    probes = []
    assert double_until_oom(lambda mb: probes.append(mb) or mb <= 40, 8) == {"fits": 32, "oom_at": 64}
    assert probes == [16, 32, 64]
    assert double_until_oom(lambda mb: True, 8, limit=16) == {"fits": 16, "oom_at": None}

    def row(name, tok, peak, mb=8):
        return {"setup": name, "label": parse_setup(name).label, "micro_batch": mb, "tokens_per_s": tok,
                "peak_gib": peak, "activation_gib": 1.0, "offloaded_gib": 0.0, "predicted_peak_gib": peak * 1.02}

    results = [row("torch:noac", 100.0, 50.0), row("torch:hf-ac", 80.0, 20.0), row("memtrain:full", 90.0, 25.0),
               row("memtrain:full+offload", 81.0, 19.0),
               {"setup": "deepspeed:cpu-ckpt", "label": "x", "micro_batch": 8, "oom": True}]
    table = markdown(results, {"memtrain:full": {"fits": 32, "oom_at": 64}})
    assert "| memtrain:full+offload |" in table and "| 0.81 |" in table and "32 (OOM at 64)" in table
    assert "| deepspeed:cpu-ckpt | x | 8 | OOM |" in table
    goals = "\n".join(targets(results))
    assert "memtrain:full+offload / memtrain:full: 0.90 (target >= 0.95) - NOT met" in goals
    assert "memtrain:full+offload / torch:noac: 0.81 (target >= 0.8) - met" in goals
    assert "19.0 vs torch:hf-ac 20.0 (target <=) - met" in goals
    assert "deepspeed:cpu-ckpt / memtrain:full (DeepSpeed's own offload, for reference): not measured" in goals


def test_gpu_check_writes_after_each_set_up_and_stops_when_the_trainer_is_broken(tmp_path):
    """What an H100 run of 2026-11-25 returned (torch 2.11 image, before memtrain ran there): the peers measured,
    every trainer set-up failing alike. The report and JSON exist after any set-up; two trainer set-ups that fail
    the same way stop the run; an OOM or a different failure does not."""
    from memtrain.tools.bench.__main__ import same_failure_twice, write_gpu_check

    broken = "AttributeError: module 'torch.nn.functional' has no attribute 'linear_cross_entropy'"
    noac = {"setup": "torch:noac", "label": "plain", "micro_batch": 8, "wall_s": 48.0, "tokens_per_s": 43996.0,
            "peak_gib": 56.6}
    fail = lambda name, error=broken, **kw: {"setup": name, "label": name, "micro_batch": 8, "wall_s": 18.0,  # noqa: E731
                                             "oom": False, "error": error, **kw}
    results = [noac, fail("memtrain:full+offload")]
    assert not same_failure_twice(results)
    write_gpu_check(tmp_path, "NVIDIA H100 80GB HBM3", "t", results, {"memtrain:full+offload": "the log"})
    written = json.loads((tmp_path / "NVIDIA-H100-80GB-HBM3.json").read_text())["results"]
    assert [r["setup"] for r in written] == ["torch:noac", "memtrain:full+offload"]
    assert (tmp_path / "failed.log").read_text() == "the log"
    assert "| torch:noac | plain |  | 8 | 43,996 | 1.00 | 56.60 |" in (tmp_path / "NVIDIA-H100-80GB-HBM3.md").read_text()
    assert same_failure_twice([*results, {"setup": "torch:hf-ac", "label": "", "micro_batch": 8, "wall_s": 46.0,
                                          "tokens_per_s": 35067.0}, fail("memtrain:op")])
    assert not same_failure_twice([*results, fail("memtrain:op", "another error")])
    assert not same_failure_twice([*results, fail("memtrain:op", oom=True)])
    no_budget = {"setup": "memtrain:auto", "label": "", "micro_batch": 8, "error": broken}  # never started
    assert not same_failure_twice([fail("memtrain:full"), no_budget])
    slow = "timed out after 300 s (killed)"  # a cold compile cache, not a broken trainer: the run goes on
    assert not same_failure_twice([fail("memtrain:op+compile", slow), fail("memtrain:auto+compile", slow)])


def test_gpu_check_resume_keeps_what_measured_and_runs_failures_again(tmp_path, capsys):
    """A gpu-check split across calls (the device lease's 10-minute limit): --resume keeps what the device's
    report measured (an OOM is a measurement), in the order asked, and runs failed set-ups again."""
    from memtrain.tools.bench.__main__ import measured_before, write_gpu_check

    ok = lambda name, **kw: {"setup": name, "label": name, "micro_batch": 8, "tokens_per_s": 1.0, **kw}  # noqa: E731
    results = [ok("torch:noac", peak_gib=50.0, measured_at="2026-11-26 10:00:00 UTC"), ok("memtrain:op"),
               {"setup": "memtrain:full", "label": "", "micro_batch": 8, "oom": False, "error": "boom"},
               {"setup": "memtrain:none", "label": "", "micro_batch": 8, "oom": True}]
    write_gpu_check(tmp_path, "NVIDIA H200", "t", results, {})
    assert measured_before(tmp_path, "NVIDIA H100", "t", ["torch:noac"]) == []  # another device's report is not this one's
    assert measured_before(tmp_path, "NVIDIA H200", "on 8 x NVIDIA H200", ["torch:noac"]) == []  # nor another check's
    assert "is the report of another check ('t', not 'on 8 x NVIDIA H200')" in capsys.readouterr().out
    kept = measured_before(tmp_path, "NVIDIA H200", "t", ["memtrain:op", "memtrain:full", "torch:noac"])
    assert [r["setup"] for r in kept] == ["memtrain:op", "torch:noac", "memtrain:none"]
    later = ok("memtrain:full", measured_at="2026-11-26 10:09:00 UTC")
    report = write_gpu_check(tmp_path, "NVIDIA H200", "t", [*kept, later], {})
    assert "Measured 2026-11-26 10:00:00 UTC to 2026-11-26 10:09:00 UTC." in report
    (tmp_path / "NVIDIA-H200.json").write_text('{"title": "t", "res')  # cut short by hand: measured again, one line
    assert measured_before(tmp_path, "NVIDIA H200", "t", ["torch:noac"]) == []
    assert "cannot be read" in capsys.readouterr().out


HANG = """import os, subprocess, sys, time
if os.environ.get("HANG_PID_FILE") and "-m" in sys.orig_argv and "memtrain.tools.bench.plain" in sys.orig_argv:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = os.environ["HANG_PID_FILE"]
    open(path + ".tmp", "w").write(str(child.pid))
    os.replace(path + ".tmp", path)  # whole, or not there
    time.sleep(600)
"""


def _child_pid(path: Path, limit_s: float = 60) -> int:
    deadline = time.time() + limit_s
    while not path.exists():
        assert time.time() < deadline, "the hung set-up never started its child"
        time.sleep(0.1)
    return int(path.read_text())


def _gone(pid: int, limit_s: float = 10) -> bool:
    deadline = time.time() + limit_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:  # not left behind for the rest of the suite
        os.kill(pid, signal.SIGKILL)
    return not alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"  # a zombie is dead (its parent was killed and init has not reaped it yet)


def test_a_hung_set_up_is_killed_with_its_children_after_the_timeout(tmp_path, monkeypatch):
    """One set-up that hangs (here before it starts, in a sitecustomize) costs --setup-timeout, not the rest of the
    run: its process and the processes it started (a launcher's ranks, compile workers) are killed, and the
    result says so."""
    from memtrain.tools.bench.runner import Runner

    env = sitecustomize_env(tmp_path / "hooks", HANG)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("HANG_PID_FILE", str(tmp_path / "child.pid"))
    run = Runner(None, [], "ds_configs/zero3_ckpt.json", 1, 0, 1, timeout_s=10)
    result = run("torch:noac")
    assert result["error"] == "timed out after 10 s (killed)" and result["wall_s"] < 60
    assert _gone(_child_pid(tmp_path / "child.pid", limit_s=0))  # written within the 10 s, before the kill


def _bench_running_a_hung_set_up(tmp_path):
    """A bench process (Runner) whose plain-PyTorch set-up hangs: the bench's Popen and the set-up's child's pid."""
    env = sitecustomize_env(tmp_path / "hooks", HANG)
    env["HANG_PID_FILE"] = str(tmp_path / "child.pid")
    script = "from memtrain.tools.bench.runner import Runner; Runner(None, [], 'ds_configs/zero3_ckpt.json', 1, 0, 1)('torch:noac')"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, _child_pid(tmp_path / "child.pid")


def test_sigterm_to_the_bench_kills_the_set_up_it_is_running(tmp_path):
    """`timeout 540 python -m memtrain.tools.bench ...` signals the bench only; the set-up runs in its own session,
    so the bench kills it on the way out instead of leaving it on the GPU."""
    proc, child = _bench_running_a_hung_set_up(tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _gone(child)


def test_a_killed_bench_takes_its_set_up_along(tmp_path):
    """A bench killed without a word (SIGKILL: the OOM killer, `kill -9`) cannot kill its set-up, which runs in a
    session of its own; the kernel kills the set-up's own process (PR_SET_PDEATHSIG), not what that one started."""
    import psutil

    proc, child = _bench_running_a_hung_set_up(tmp_path)
    setup = psutil.Process(child).ppid()
    assert setup != proc.pid and psutil.Process(setup).ppid() == proc.pid
    proc.kill()
    proc.communicate(timeout=30)
    assert _gone(setup)
    _gone(child, limit_s=0)  # the set-up's own child is the kernel's to reparent: cleaned up here


@pytest.mark.parametrize("argv, line", [
    (["--setup-timeout", "0"], "--setup-timeout: must be positive seconds (got 0)"),
    (["--resume"], "--resume: continues a --gpu-check run; make bench has nothing to resume"),
])
def test_bench_flag_mistakes_are_one_line(argv, line, capsys):
    from memtrain.tools.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(line), err


def test_bench_host_counts_zero3_work_beside_plain_pytorch(tmp_path):
    """make bench-host: the trainer with train.probe and the plain peer in one run, each pinned to one core;
    the report carries the counters (no fetch inside memtrain's recompute) and the plot."""
    from memtrain.tools.bench.host import run

    results = run(["torch:noac", "memtrain:full", "memtrain:full-leaf-resident"], steps=2, warmup=3, cores=1,
                  out=tmp_path, repeats=1)
    plain, full, hooked = results
    assert plain["probe"]["aten_ops"] > 0 and plain["probe"]["cpu_s"] > 0
    assert full["probe"]["fetches"] == {"forward": 10, "recompute": 0, "backward": 9}  # tiny Llama: 4 leaf layers
    assert hooked["probe"]["fetches"]["recompute"] == 48  # 12 hooked submodules per layer fetch again
    assert full["probe"]["aten_ops"] > 0
    report = (tmp_path / "host_overhead.md").read_text()
    assert "| memtrain:full | trainer, policy 'full' |" in report and "10 / 0 / 9" in report
    assert "ZeRO-3 fetches inside the recompute, memtrain:full: 0 (target 0) - met" in report
    assert (tmp_path / "host_overhead.png").stat().st_size > 0


def test_bench_host_shows_the_median_round_and_the_range():
    """Interleaved rounds: each set-up shows its median run (with that run's counters) and every round's tokens/s;
    a failure in any round is shown, never hidden behind the other rounds."""
    from memtrain.tools.bench.host import markdown, median_runs

    rounds = [{"setup": "torch:noac", "label": "plain", "tokens_per_s": t, "probe": {"cpu_s": t / 1e6}}
              for t in (9000.0, 12000.0, 10000.0)]
    best = median_runs(rounds)
    assert best["tokens_per_s"] == 10000.0 and best["probe"]["cpu_s"] == 0.01
    assert best["tokens_per_s_runs"] == [9000.0, 12000.0, 10000.0]
    assert "| torch:noac | plain | 10,000 | 9,000-12,000 | 1.00 |" in markdown([best])
    assert median_runs([*rounds[:2], {"setup": "torch:noac", "error": "boom"}]) == {"setup": "torch:noac",
                                                                                      "error": "boom"}


def test_bench_host_legend_clears_the_axis_label(tmp_path, monkeypatch):
    """make bench-host's plot: the legend sits below the x-axis label, not over it (their boxes as drawn)."""
    from matplotlib.figure import Figure

    from memtrain.tools.bench.host import plot

    boxes = {}
    real_savefig = Figure.savefig

    def keep(fig, path, *a, **k):
        def drawn(event):  # the boxes as the file has them (saved at its own dpi)
            legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()  # the figure's or the axes'
            boxes.update(label=fig.axes[0].xaxis.label.get_window_extent(event.renderer),
                         legend=legend.get_window_extent(event.renderer), figure=fig.bbox)

        fig.canvas.mpl_connect("draw_event", drawn)
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    rows = [{"setup": s, "tokens_per_s": t} for s, t in (("torch:noac", 1000.0), ("torch:hf-ac", 800.0),
                                                         ("memtrain:full", 700.0), ("memtrain:full-leaf-resident", 500.0))]
    plot(rows, tmp_path / "host.png", "a title")
    assert not boxes["legend"].overlaps(boxes["label"]) and boxes["legend"].y1 < boxes["label"].y0, boxes
    assert boxes["legend"].y0 >= boxes["figure"].y0  # and inside the figure

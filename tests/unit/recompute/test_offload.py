"""memtrain's offload of checkpointed activations (cpu_checkpointing), on CPU.

In-process tests run the real scheduling code (slots, prefetch, pool) with two copy engines:
the CPU one the trainer uses (plain copies), and `DeferredCopies`, which behaves like CUDA's
side stream (copies run later, in order, only once waited for), so a missing wait or a buffer
recycled too early shows up as wrong numbers. One launch checks the real ZeRO-3 path.
"""
import copy
import gc
import re
import weakref

import pytest
import torch

from conftest import SMALL_LLAMA
from memtrain.recompute.hooks import apply_plan, checkpoint_function
from memtrain.recompute.policy import plan_for
from memtrain.errors import UserError
from memtrain.recompute.meter import ActivationMeter
from memtrain.model.build import build_config, build_model, decoder_layers
from memtrain.recompute.offload import ActivationOffloader, HostBufferPool, offload_flags, offload_units
from memtrain.config.recipe import DEFAULT_OP_SAVE, ModelSection
from memtrain.recompute.compiled import CompiledLayers

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


def _steps(model, ids, steps, deferred=False, after_forward=None, collect=False):
    """Train-like steps (forward under the meter, backward); per step: grads, meter bytes, and
    which layer inputs were still alive after the forward (`after_forward()` runs there too; `collect`: after a
    garbage collection)."""
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
        if collect:
            gc.collect()
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
    for step, (grads, device_bytes, host_bytes, alive) in enumerate(_steps(model, ids, 3, deferred=True, collect=True)):
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
        assert host_bytes == 3 * 2 * 32 * 64 * 4  # three layer inputs of 2x32x64 float32
        # offloaded inputs are freed in the steady state; in the first step dynamo compiles while the layers run, and
        # once (1 CI run in about 30) the first two layers' inputs were still referenced after it: not this code's
        assert step == 0 or alive == [False, False, False, True], step
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


def _held_by_the_graph(model, ids) -> int:
    """Bytes the CPU allocator frees when the loss goes, after the backward: what the spent graph still holds (the
    trainer holds the loss through the optimizer step). torch.profiler's allocator events over the step's forward and
    backward and the loss's deletion; the second step's (the pool's buffers are made in the first)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        prof.start()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        with torch.profiler.record_function("backward done"):
            pass
        del loss
        prof.stop()
    events = prof.profiler.kineto_results.events()
    done = next(e.start_ns() for e in events if e.name() == "backward done")
    return -sum(e.nbytes() for e in events if e.name() == "[memory]" and e.start_ns() > done)


def test_deepspeed_restored_inputs_go_with_their_layers_backward(base, ids):
    """An offloaded DeepSpeed checkpoint's input, restored for its backward, goes when DeepSpeed drops it: the spent
    graph holds no more with offload than without (it held the 3 offloaded inputs, 16 KiB each, when the backward
    hook kept them: on one H100, 1.31 GiB above policy full's peak)."""
    held = {}
    for offload in (False, True):
        model = copy.deepcopy(base)
        apply_plan(model, _plan("deepspeed", offload))
        held[offload] = _held_by_the_graph(model, ids)
    assert held[True] == held[False], held


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

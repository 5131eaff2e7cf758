"""memtrain's offload of checkpointed activations (cpu_checkpointing), on CPU.

In-process tests run the real scheduling code (slots, prefetch, pool) with two copy engines:
the CPU one the trainer uses (plain copies), and `DeferredCopies`, which behaves like CUDA's
side stream (copies run later, in order, only once waited for), so a missing wait or a buffer
recycled too early shows up as wrong numbers. One launch checks the real ZeRO-3 path.
"""
import copy
import json
import weakref

import pytest
import torch

from conftest import FAST, ROOT, assert_ok, run_train
from memtrain.ac import apply_plan, build_plan, checkpoint_function
from memtrain.ds_config import ac_section
from memtrain.errors import UserError
from memtrain.metrics import ActivationMeter
from memtrain.model import build_config, build_model, decoder_layers
from memtrain.offload import ActivationOffloader, HostBufferPool, offload_flags
from memtrain.recipe import ACSection, ModelSection
from memtrain.tb import read_scalars

LLAMA = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
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
def base():
    section = ModelSection(type="llama", config=LLAMA)
    config = build_config(section, vocab_size=257, seq_len=32)
    torch.manual_seed(0)
    return build_model(section, config).train()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


def _plan(backend, cpu_checkpointing, skip_last=1, policy="full"):
    ds = {"activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing}}
    return build_plan(policy, backend, ac_section(ds), LLAMA["num_hidden_layers"],
                      section=ACSection(offload_skip_last=skip_last))


def _steps(model, ids, steps, deferred=False):
    """Train-like steps (forward under the meter, backward); per step: grads, meter bytes, and
    which layer inputs were still alive after the forward."""
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
def test_offloaded_tensors_come_back_bit_exact(backend):
    """Each offloaded input (dtypes, a non-contiguous one) reaches the recompute bit for bit."""
    plan = build_plan("full", backend, ac_section(OFFLOAD_JSON), 3, section=ACSection(offload_skip_last=0))
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
    plan = _plan("deepspeed", True, skip_last=2)
    assert plan.offload == (True, True, False, False)
    assert "memtrain offload of 2/4" in plan.describe() and "DeepSpeed's own CPU_CHECKPOINT off" in plan.describe()
    assert "H H D D" in plan.describe()
    ds_own = build_plan("full", "deepspeed", ac_section(OFFLOAD_JSON), 4,
                        section=ACSection(cpu_checkpointing_impl="deepspeed"))
    assert not ds_own.memtrain_offload and "DeepSpeed's own CPU_CHECKPOINT copies" in ds_own.describe()
    assert "cpu_checkpointing: off" in _plan("torch", False).describe()
    with pytest.raises(UserError, match="activation_checkpointing.cpu_checkpointing_impl"):
        build_plan("full", "torch", ac_section(OFFLOAD_JSON), 4, section=ACSection(cpu_checkpointing_impl="deepspeed"))


def test_zero3_two_ranks_with_cpu_checkpointing(tmp_path):
    """The real launcher, ZeRO-3, 2 CPU ranks, the JSON's cpu_checkpointing on (auto -> deepspeed backend)."""
    ds_path = ROOT / "ds_configs" / "zero3_cpu_ckpt.json"
    assert json.loads(ds_path.read_text())["activation_checkpointing"]["cpu_checkpointing"] is True
    run_dir = tmp_path / "run"
    proc = run_train(["--deepspeed", str(ds_path), "--run-dir", str(run_dir), "--max-steps", "6", *FAST], nproc=2)
    assert_ok(proc)
    assert "memtrain offload of 3/4 recomputed layers' inputs" in proc.stdout
    assert "DeepSpeed's own CPU_CHECKPOINT off" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ac_plan"]["offload"] == [True, True, True, False]
    scalars = read_scalars(run_dir / "tb")
    # embedded tiny recipe with FAST: 3 offloaded inputs of micro-batch 4 x seq 64 x hidden 128, float32
    assert [v for _, v in scalars["memory/offloaded_activation_gib"]] == [3 * 4 * 64 * 128 * 4 / 2**30] * 6
    loss = [v for _, v in scalars["train/loss"]]
    assert len(loss) == 6 and loss[-1] < loss[0]


# --------------------------------------------------------------------------- the benchmark's pieces

def test_bench_runs_the_trainer_with_offload(tmp_path):
    """A bench set-up is the trainer itself (src/train.py) with bench settings: random tokens, no
    model checkpoint, figures from its summary.json; the plain baseline is its own process."""
    from memtrain.bench.__main__ import Runner

    run = Runner(None, ["model.config.num_hidden_layers=2", "data.seq_len=64", "train.micro_batch_size=2"],
                 str(ROOT / "ds_configs" / "zero3_ckpt.json"), steps=2, warmup=1, ngpus=1)
    result = run("memtrain:full+offload@torch")
    assert "error" not in result, result
    assert result["tokens_per_s"] > 0 and result["peak_gib"] is None  # CPU: no GPU peak
    assert result["plan"] == "RR" and result["world_size"] == 1
    # layer 0's input (micro-batch 2 x seq 64 x hidden 128, float32) went to host; layer 1's stayed
    assert result["offloaded_gib"] * 2**30 == 2 * 64 * 128 * 4
    assert not list(run.tmp.glob("*/checkpoints"))  # bench settings: no model checkpoint written
    plain = run("torch:noac")
    assert "error" not in plain and plain["tokens_per_s"] > 0 and plain["world_size"] == 1


def test_bench_setups_search_and_table():
    from memtrain.bench.__main__ import double_until_oom
    from memtrain.bench.setups import parse_setup
    from memtrain.bench.table import markdown, targets

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

"""Memory model: a training step's peak device memory, predicted before the run.

    peak = model states (parameters, gradients, optimizer states: ZeRO stage, offload, world size)
         + activations (saved per layer, the recompute working set, logits and loss buffers)
         + the allocator's margin

Activation sizes are measured, not derived from formulas: the real transformers model with one
decoder layer runs one forward and backward per AC mode at the target micro-batch, sequence
length and dtype, on fake tensors (`FakeTensorMode`: shapes only, nothing allocated); a 2-layer
run separates the layer from what lies around it. A tracker follows every tensor storage through
the step (`_StepTracker`), so the measurement covers any decoder family, attention kernel, dtype
and whatever the AC modes really keep. The layer count scales it: the live bytes at any point
are prefix sums of per-layer costs (`activation_peak`), which tests check against real steps.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ac
from .ds_config import AUTO
from .errors import UserError
from .metrics import GIB, ActivationMeter

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes


# --------------------------------------------------------------------------- target

@dataclass(frozen=True)
class Target:
    """What the prediction is for: one device of a run."""

    device: str  # "cuda" or "cpu"
    dtype: str  # compute dtype of activations: "float32" | "bfloat16" | "float16"
    micro_batch_size: int
    seq_len: int
    world_size: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def compute_dtype(ds_config: dict, device: str) -> str:
    """The dtype DeepSpeed computes in. bf16 "auto" means on where supported: a GPU here."""
    def enabled(key):
        value = (ds_config.get(key) or {}).get("enabled", False)
        if value != AUTO:
            return bool(value)
        if device == "cuda" and torch.cuda.is_available():
            return key == "bf16" and torch.cuda.is_bf16_supported()  # as resolve_ds_config fills it
        return device == "cuda" and key == "bf16"  # planning for a GPU from a host without one

    if enabled("bf16"):
        return "bfloat16"
    if enabled("fp16"):
        return "float16"
    return "float32"


def make_target(recipe, ds_config: dict, world_size: int, device: Optional[str] = None) -> Target:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Target(device, compute_dtype(ds_config, device), recipe.train.micro_batch_size,
                  recipe.data.seq_len, world_size)


# --------------------------------------------------------------------------- model states

@dataclass(frozen=True)
class ModelStates:
    """Bytes per device for parameters, gradients and optimizer states, and what sits on the host."""

    params: int  # this rank's parameters (its partition under ZeRO-3)
    grads: int
    optimizer: int  # fp32 master copy and Adam's two moments
    buckets: int  # ZeRO-3's contiguous reduce bucket (allocated in full, whatever the model size)
    persistent: int  # ZeRO-3: parameters below the persistence threshold, also kept whole on every rank
    gathered: int  # ZeRO-3: the module being computed and the prefetch bucket, gathered in full
    update: int  # fp32 gradients made for the update (mixed precision); only during the step, with no activations
    host: int  # offloaded to host memory (not part of the device peak)

    @property
    def total(self) -> int:
        """What is on the device through the forward and backward."""
        return self.params + self.grads + self.optimizer + self.buckets + self.persistent + self.gathered


def model_states(profile: "ActivationProfile", ds_config: dict, target: Target) -> ModelStates:
    """DeepSpeed's layout, component by component, with DeepSpeed's own defaults for its JSON.

    c = compute bytes per parameter (2 in bf16/fp16, 4 in fp32). Adam keeps two fp32 moments (8)
    beside an fp32 master copy (4; stages 1-3 keep one in fp32 training too, as measured on CPU).
    Stage >= 1 shards the optimizer, >= 2 the gradients, 3 the parameters.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))
    n, world, stage = profile.num_params, target.world_size, int(zero.stage)
    c = torch.tensor([], dtype=target.torch_dtype).element_size()
    offloaded = lambda o: o is not None and str(getattr(o.device, "value", o.device)) in ("cpu", "nvme")  # noqa: E731
    offload_opt = stage >= 1 and offloaded(zero.offload_optimizer)
    offload_param = stage == 3 and offloaded(zero.offload_param)
    mixed = c < 4
    master = 4 if (stage >= 1 or mixed) else 0

    params = c * n // (world if stage == 3 else 1)
    grads = c * n // (world if stage >= 2 else 1)
    optimizer = (master + 8) * n // (world if stage >= 1 else 1)
    update = 4 * n // (world if stage >= 1 else 1) if mixed else 0
    buckets = persistent = gathered = 0
    if stage == 3:
        buckets = c * zero.reduce_bucket_size if zero.contiguous_gradients else 0
        small = sum(numel * count for numel, count in profile.param_sizes
                    if numel <= zero.param_persistence_threshold)
        persistent = c * small if world > 1 else 0  # in a world of one the partition is the parameter (measured)
        gathered = c * (profile.largest_layer_params + min(zero.prefetch_bucket_size, n))
    host = 0
    if offload_opt:  # the update runs on the host: optimizer states and gradient partitions live there
        host += optimizer + update + (grads if stage >= 2 else 0)
        optimizer = update = 0
        grads = grads if stage < 2 else 0
    if offload_param:
        host += params
        params = 0
    return ModelStates(params, grads, optimizer, buckets, persistent, gathered, update, host)


# --------------------------------------------------------------------------- measurement

class _FakeMeter(ActivationMeter):
    """ActivationMeter whose storage identity also works for fake tensors (they have no address)."""

    def _alive_bytes(self) -> int:
        storages: dict[int, int] = {}
        for ref in self._refs:
            t = ref()
            if t is not None:
                s = t.untyped_storage()
                storages[s._cdata] = s.nbytes()
        return sum(storages.values())


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (flat, or one level of lists/tuples/dicts)."""
    out = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
        elif isinstance(x, dict):
            out.extend(y for y in x.values() if isinstance(y, torch.Tensor))
    return out


class _StepTracker(TorchDispatchMode):
    """Follows a step op by op: every storage an op creates and the moment it dies.

    Liveness is read from weak references to the C++ storages themselves, swept after every op,
    so a storage counts as freed exactly when its memory would go back to the allocator (Python
    garbage collection plays no part). Works alike on real and on fake tensors.
    """

    def __init__(self, flops: Callable[[], float], block: int = 1) -> None:
        super().__init__()
        self.block = block
        self.flops = flops  # running FLOP total of the step so far
        self.events: list[tuple[int, int]] = []  # (+bytes at allocation | -bytes at free, storage serial)
        self.marks: dict[str, tuple[int, float, int]] = {}  # name -> (event index, FLOPs, bytes written)
        self._live: dict[int, tuple[int, int, int]] = {}  # storage key -> (weak C++ ref, bytes, serial)
        self.written = 0  # bytes written into fresh storage: the memory-traffic proxy of the step

    def mark(self, name: str) -> None:
        self._sweep()
        self.marks[name] = (len(self.events), self.flops(), self.written)

    def serial(self, storage) -> Optional[int]:
        entry = self._live.get(storage._cdata)
        return entry[2] if entry else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in _tensors((*args, *kwargs.values()))}
        out = func(*args, **kwargs)
        self._sweep()
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            storage = t.untyped_storage()
            if storage._cdata not in inputs:  # views and in-place results allocate nothing
                self._track(storage)
        return out

    def _sweep(self) -> None:
        expired = torch.UntypedStorage._expired  # what StorageWeakRef.expired calls, without the wrapper
        dead = [key for key, (ref, _, _) in self._live.items() if expired(ref)]
        for key in dead:
            _, nbytes, serial = self._live.pop(key)
            self.events.append((-nbytes, serial))

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        nbytes = math.ceil(storage.nbytes() / self.block) * self.block
        serial = len(self.events)
        self._live[key] = (storage._weak_ref(), nbytes, serial)
        self.written += nbytes
        self.events.append((nbytes, serial))

    def curve(self, exclude: set[int]) -> list[int]:
        """Live bytes after each event, leaving out the storages in `exclude` (parameter gradients)."""
        live, out = 0, [0]
        for delta, serial in self.events:
            if serial not in exclude:
                live += delta
            out.append(live)
        return out


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer under one AC mode, measured at the target shape."""

    saved: int  # bytes it keeps for backward at the end of the forward (ActivationMeter's measure)
    resident: int  # bytes its forward leaves alive on the device (saved + its output, less its input)
    fwd_excess: int  # transient peak above `resident`-so-far while it runs forward
    bwd_excess: int  # transient peak while it runs backward: the recompute working set for recomputed modes
    input_bytes: int  # its checkpointed input (what offload moves to the host)
    fwd_flops: float
    bwd_flops: float  # including any recompute
    bwd_written: float  # bytes its backward (and recompute) writes
    recompute_flops: float = 0.0  # extra backward FLOPs over keeping everything
    recompute_written: float = 0.0  # extra bytes written over keeping everything


@dataclass(frozen=True)
class ActivationProfile:
    """Measured activation costs of a model at one target shape; additive over layers."""

    target: Target
    num_layers: int
    num_params: int
    largest_layer_params: int
    param_sizes: tuple[tuple[int, int], ...]  # (elements, how many parameters of that size) over the model
    layers: dict[str, LayerCost]  # per AC mode
    outside_saved: int  # what embeddings, final norm, logits and loss keep for backward
    base: int  # alive before the first layer's forward (embeddings output, rotary tables)
    head_excess: int  # peak of logits, loss and their backward above everything saved
    head_net: int  # left alive after the head's backward (gradient of the last hidden states, ...)
    tail_excess: int  # peak after the first layer's backward (embedding backward)
    largest_block: int  # the largest single allocation of the step

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, micro_batch_size: int) -> "ActivationProfile":
        """Every activation carries the batch dimension, so sizes scale linearly with the micro-batch."""
        f = micro_batch_size / self.target.micro_batch_size
        sc = lambda v: int(round(v * f)) if isinstance(v, int) else v * f  # noqa: E731
        layers = {m: LayerCost(**{k: sc(v) for k, v in asdict(c).items()}) for m, c in self.layers.items()}
        fields = {k: sc(getattr(self, k)) for k in ("outside_saved", "base", "head_excess", "head_net",
                                                      "tail_excess", "largest_block")}
        target = Target(**{**asdict(self.target), "micro_batch_size": micro_batch_size})
        return replace(self, target=target, layers=layers, **fields)


def supported_modes() -> tuple[str, ...]:
    """The per-layer AC modes memtrain.ac implements ("keep", "full", and the selective ones)."""
    modes = getattr(ac, "LAYER_MODES", (ac.KEEP, ac.RECOMPUTE))
    return tuple(m for m in ("keep", "op", "attn", "mlp", "full") if m in modes)


def _layer_config(config, num_layers: int):
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):  # per-layer attention kinds (sliding, full)
        cfg.layer_types = cfg.layer_types[:num_layers]
    return cfg


def _param_shapes(model, num_layers: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """From a 1-layer model: (parameters of the num_layers model, the largest single module's,
    histogram of parameter sizes), tied parameters counted once."""
    from collections import Counter

    from .model import decoder_layers

    unique = {id(p): p for p in model.parameters()}
    _, layers = decoder_layers(model)
    in_layer = {id(p) for p in layers[0].parameters()}
    sizes = Counter(p.numel() for k, p in unique.items() if k not in in_layer)
    for p in layers[0].parameters():
        sizes[p.numel()] += num_layers
    total = sum(numel * count for numel, count in sizes.items())
    largest = max(sum(p.numel() for p in m.parameters(recurse=m is layers[0])) for m in model.modules())
    return total, largest, tuple(sorted(sizes.items()))


def _run(model, modes: tuple[str, ...], target: Target) -> dict:
    """One forward+backward under a per-layer plan: the live-bytes curve with per-layer marks."""
    from .ac_profile import _flop_counter
    from .model import decoder_layers

    _, layers = decoder_layers(model)
    ac.apply_plan(model, ac.ACPlan(policy="profile", layers=modes, backend="torch"))
    flop_counter = _flop_counter()
    tracker = _StepTracker(flop_counter.get_total_flops, CUDA_BLOCK if target.device == "cuda" else 1)
    state = {"backward": False, "input_bytes": 0}
    handles = []

    # Marks: a layer's forward starts/ends with its module call; its backward starts when the
    # gradient of its output is ready and ends when the gradient of its input is.
    for k, layer in enumerate(layers):
        def pre(module, args, kwargs, k=k):
            if state["backward"]:  # a recompute, not the forward
                return
            tracker.mark(f"fwd_start{k}")
            x = args[0] if args else kwargs["hidden_states"]
            state["input_bytes"] = x.untyped_storage().nbytes()
            if x.requires_grad:
                x.register_hook(lambda g, k=k: tracker.mark(f"bwd_end{k}"))

        def post(module, args, kwargs, out, k=k):
            if state["backward"]:
                return
            tracker.mark(f"fwd_end{k}")
            y = out[0] if isinstance(out, (tuple, list)) else out
            y.register_hook(lambda g, k=k: tracker.mark(f"bwd_start{k}"))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (target.micro_batch_size, target.seq_len), device=device)
    meter = _FakeMeter()
    try:
        with flop_counter, tracker:
            with meter.measure():
                loss = model(input_ids=ids, labels=ids).loss
            state["backward"] = True
            loss.backward()
            del loss
            tracker.mark("end")
    finally:
        for h in handles:
            h.remove()
        ac.remove_plan(model)
    grads = {tracker.serial(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return {"curve": tracker.curve(grads), "marks": tracker.marks, "saved": meter.bytes,
            "input_bytes": state["input_bytes"],
            "largest_block": max((d for d, s in tracker.events if s not in grads), default=0)}


def _fake_model(config, num_layers: int, target: Target):
    from transformers import AutoModelForCausalLM

    with torch.device(_fake_device(target)):
        model = AutoModelForCausalLM.from_config(_layer_config(config, num_layers), dtype=target.torch_dtype)
    return model.train()


def _fake_device(target: Target) -> str:
    """Fake CUDA tensors need a CUDA build (checkpoint saves the device RNG); elsewhere fake CPU ones."""
    return "cuda" if target.device == "cuda" and torch.cuda.is_available() else "cpu"


@contextmanager
def _no_packed_sequences():
    """Decide transformers' one data-dependent mask question as the real step does.

    memtrain passes no attention mask and positions 0..S-1 in every row, so transformers finds no
    packed sequences and lets SDPA apply causality itself. Fake tensors hold no values, so it would
    assume packing and build a (batch, 1, S, S) mask the real step never has.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def profile_activations(config, target: Target, modes: Optional[tuple[str, ...]] = None) -> ActivationProfile:
    """Measure one layer per AC mode, and the parts around the layers, on fake tensors.

    A 1-layer model runs once per mode: its layer's window of the live-bytes curve gives what the
    layer leaves alive, its transient peaks and its FLOPs. A 2-layer model without recompute runs
    once more: the difference in saved bytes is one kept layer, which separates what the layer
    saves from what embeddings, final norm, logits and loss save (the same in every mode).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = tuple(modes or supported_modes())
    if ac.KEEP not in modes:
        modes = (ac.KEEP, *modes)
    key = (config.to_json_string(), target, modes)
    if key not in _PROFILES:
        _PROFILES[key] = _measure_profile(config, target, modes)
    return _PROFILES[key]


_PROFILES: dict[tuple, "ActivationProfile"] = {}  # deterministic: measure once per process


def _measure_profile(config, target: Target, modes: tuple[str, ...]) -> ActivationProfile:
    from torch._subclasses.fake_tensor import FakeTensorMode

    runs: dict[str, dict] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), _no_packed_sequences():
        model = _fake_model(config, 1, target)
        num_params, largest, param_sizes = _param_shapes(model, config.num_hidden_layers)
        for mode in modes:
            runs[mode] = _run(model, (mode,), target)
        two_keep = _run(_fake_model(config, 2, target), (ac.KEEP, ac.KEEP), target)
    outside_saved = 2 * runs[ac.KEEP]["saved"] - two_keep["saved"]

    def live(run, mark):
        return run["curve"][run["marks"][mark][0]]

    def peak(run, start, stop):
        return max(run["curve"][run["marks"][start][0]:run["marks"][stop][0] + 1])

    def delta(run, start, stop, what):  # FLOPs (1) or bytes written (2) between two marks
        return run["marks"][stop][what] - run["marks"][start][what]

    layers = {}
    for mode, run in runs.items():
        layers[mode] = LayerCost(
            saved=run["saved"] - outside_saved,
            resident=live(run, "fwd_end0") - live(run, "fwd_start0"),
            fwd_excess=peak(run, "fwd_start0", "fwd_end0") - live(run, "fwd_start0"),
            bwd_excess=peak(run, "bwd_start0", "bwd_end0") - live(run, "bwd_start0"),
            input_bytes=run["input_bytes"],
            fwd_flops=delta(run, "fwd_start0", "fwd_end0", 1),
            bwd_flops=delta(run, "bwd_start0", "bwd_end0", 1),
            bwd_written=delta(run, "bwd_start0", "bwd_end0", 2),
        )
    keep = layers[ac.KEEP]
    layers = {m: LayerCost(**{**asdict(c), "recompute_flops": max(0.0, c.bwd_flops - keep.bwd_flops),
                              "recompute_written": max(0.0, c.bwd_written - keep.bwd_written)})
              for m, c in layers.items()}
    run = runs[ac.KEEP]  # the parts around the layers do not depend on the layers' mode
    return ActivationProfile(
        target=target,
        num_layers=config.num_hidden_layers,
        num_params=num_params,
        largest_layer_params=largest,
        param_sizes=param_sizes,
        layers=layers,
        outside_saved=outside_saved,
        base=live(run, "fwd_start0"),
        head_excess=peak(run, "fwd_end0", "bwd_start0") - live(run, "fwd_end0"),
        head_net=live(run, "bwd_start0") - live(run, "fwd_end0"),
        tail_excess=peak(run, "bwd_end0", "end") - live(run, "bwd_end0"),
        largest_block=max(r["largest_block"] for r in (*runs.values(), two_keep)),
    )


def model_and_config(recipe, seq_len: Optional[int] = None):
    """The transformers config the trainer builds for this recipe (tokenizer included)."""
    from .data import build_tokenizer
    from .model import build_config

    tokenizer = build_tokenizer(recipe.data.tokenizer)
    return build_config(recipe.model, tokenizer.vocab_size, seq_len or recipe.data.seq_len)


# --------------------------------------------------------------------------- prediction

OFFLOAD = "+offload"


def choice_mode(choice: str) -> tuple[str, bool]:
    """'full+offload' -> ('full', True); 'attn' -> ('attn', False)."""
    return (choice[: -len(OFFLOAD)], True) if choice.endswith(OFFLOAD) else (choice, False)


@dataclass
class Prediction:
    """Predicted peak device memory of one training step, by component (bytes)."""

    model_states: ModelStates
    saved_activations: int  # at the end of the forward (what ActivationMeter measures), device part
    saved_per_layer: dict[str, int]  # per choice: bytes one layer keeps on the device
    recompute_working_set: int  # the largest recomputed layer's backward working set
    logits_and_loss: int  # saved outside the layers plus the head's transient peak
    activation_peak: int  # the activation part of the peak, over forward, loss and backward
    margin: int  # allocator margin: one more block of the step's largest allocation (CUDA only)
    phase: str  # where the peak happens
    host_activations: int = 0  # offloaded checkpoints on the host

    @property
    def peak(self) -> int:
        """The larger of the forward/backward peak and the optimizer step's (no activations then)."""
        return self.model_states.total + max(self.activation_peak, self.model_states.update) + self.margin

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_states"]["total"] = self.model_states.total
        d["peak"] = self.peak
        return d


def layer_footprint(profile: ActivationProfile, choice: str) -> tuple[int, int, int]:
    """(resident, forward transient, backward transient) of one layer on the device for a choice."""
    mode, offload = choice_mode(choice)
    c = profile.layers[mode]
    moved = c.input_bytes if offload else 0
    return c.resident - moved, c.fwd_excess, c.bwd_excess + moved  # offloaded input comes back for backward


def activation_peak(profile: ActivationProfile, choices: tuple[str, ...]) -> tuple[int, str]:
    """The activation peak of a plan, and its phase.

    Forward of layer i: base + resident of layers < i + its forward transient.
    Head (logits, loss, their backward): base + all residents + head transient.
    Backward of layer i: base + residents of layers <= i + head_net + its backward transient.
    """
    best, phase, prefix = 0, "", profile.base
    for i, choice in enumerate(choices):
        resident, fwd, bwd = layer_footprint(profile, choice)
        for value, name in ((prefix + fwd, f"forward of layer {i}"),
                            (prefix + resident + profile.head_net + bwd, f"backward of layer {i}")):
            if value > best:
                best, phase = value, name
        prefix += resident
    if prefix + profile.head_excess > best:
        best, phase = prefix + profile.head_excess, "logits/loss"
    tail = profile.base + profile.head_net + profile.tail_excess
    if tail > best:
        best, phase = tail, "embedding backward"
    return best, phase


def predict(profile: ActivationProfile, states: ModelStates, choices: tuple[str, ...]) -> Prediction:
    peak, phase = activation_peak(profile, choices)
    saved_per = {}
    for choice in dict.fromkeys(choices):
        mode, offload = choice_mode(choice)
        saved_per[choice] = profile.layers[mode].saved - (profile.layers[mode].input_bytes if offload else 0)
    recomputed = [layer_footprint(profile, c)[2] for c in choices if choice_mode(c)[0] != ac.KEEP]
    host = sum(profile.layers[choice_mode(c)[0]].input_bytes for c in choices if choice_mode(c)[1])
    return Prediction(
        model_states=states,
        saved_activations=profile.outside_saved + sum(saved_per[c] for c in choices),
        saved_per_layer=saved_per,
        recompute_working_set=max(recomputed, default=0),
        logits_and_loss=profile.outside_saved + profile.head_excess,
        activation_peak=peak,
        margin=profile.largest_block if profile.target.device == "cuda" else 0,
        phase=phase,
        host_activations=host,
    )


# --------------------------------------------------------------------------- device rates

@dataclass(frozen=True)
class Rates:
    """Measured speeds of this machine's device, for the planner's step-time model."""

    flops_per_s: float  # dense matmul in the compute dtype
    bytes_per_s: float  # device memory copy (bytes written per second)
    host_bytes_per_s: float  # device <-> host copy; 0 where there is no separate device memory
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def _timed(fn, reps: int = 3) -> float:
    from .metrics import synchronize

    fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / reps


def measure_rates(dtype: str = "float32") -> Rates:
    """A few quick timings on this machine's device (a fraction of a second on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype) if device == "cuda" else torch.float32  # CPU matmuls run fastest in fp32
    n = 4096 if device == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dt)
    flops = 2 * n**3 / _timed(lambda: a @ a)
    buf = torch.empty(64 << 20 if device == "cuda" else 16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    copy_bw = buf.numel() / _timed(lambda: dst.copy_(buf))
    host_bw = 0.0
    if device == "cuda":
        host = torch.empty_like(buf, device="cpu").pin_memory()
        host_bw = buf.numel() / _timed(lambda: host.copy_(buf, non_blocking=True))
    return Rates(flops, copy_bw, host_bw, device)


def gib(x: float) -> float:
    return x / GIB


def parse_size(text: str, key: str) -> int:
    """'40GiB', '40G', '512MiB', '40' (GiB) -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UserError(f"{key}: '{text}' is not a memory size (e.g. 40GiB, 512MiB)")
    unit = {"": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)

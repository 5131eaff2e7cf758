"""A configuration's predicted step time, term by term, from its FLOPs, collectives and copies on a hardware sheet.

    micro-step = compute + recompute/offload (the per-layer solver's seconds)
               + exposed ZeRO communication + TP all-reduces + Ulysses all-to-alls + exposed offload copies
    step       = grad_accum x micro-step + the step's own collectives + the optimizer step

* compute: the model's FLOPs on this rank / (dense peak x compute efficiency; the sheet's, or calibrated);
* recompute and activation offload: `memtrain.memory.planner.choice_seconds` of each layer's choice
  at the sheet's rates (the same seconds the per-layer solver minimises): a recompute costs the longer of its
  device seconds and its aten ops dispatched again x the sheet's `overhead.host_op_s`;
* a collective: the bytes a rank sends (`memtrain.memory.comm_volume`, ring algorithms) / the link's
  rate (inside a node or across nodes, by where its group's ranks sit) + a latency per call; the bytes sent
  inside the node are kept (`StepTime.intra_bytes`): `plan --verify` fits the intra-node rate to them on a CPU;
* overlap (an assumption, ZERO_OVERLAP): DeepSpeed runs ZeRO's gathers (prefetch) and gradient
  reductions (overlap_comm) on side streams, hidden behind up to that fraction of the micro-step's
  compute; on a CPU device nothing is hidden (zero_overlap); AutoTP's all-reduces and Ulysses'
  all-to-alls sit on the compute path and are never hidden; the step's own collectives (ZeRO-0's
  all-reduce, ZeRO-1/2's parameter all-gather) run after the backward and are never hidden;
* optimizer: Adam streams ADAM_BYTES_PER_PARAM per trained parameter of the rank's partition,
  through HBM on the GPU, or through the node's host memory with CPU Adam (offload_optimizer; the
  node's ranks share its bandwidth);
* offload copies: gradients to the host every micro-step and parameters back every step
  (offload_optimizer), each parameter gather's partition from the host (offload_param), at the
  host link's rate, not hidden;
* overhead: per-call costs the rates above do not see (Python, the dispatcher, hooks, a collective's
  fixed cost beyond the link's latency), on the compute path, never hidden: the sheet's
  `overhead.layer_s` per decoder layer's forward and backward (a recomputed layer re-runs a share of
  its calls, RECOMPUTE_CALLS), `overhead.collective_s` per collective call, `overhead.step_s` per
  optimizer step. 0 unless a calibration file holds them (`plan --verify` fits them from measured runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memtrain.memory.comm_volume import MICRO, Collective, Layout
from memtrain.memory.hardware import Hardware

# Fraction of a micro-step's compute time behind which DeepSpeed hides ZeRO's side-stream collectives
# (stage-3 prefetch gathers, overlap_comm reductions). An assumption, not measured: Galvatron reports
# overlapped communication slowing compute by 1.1-1.3x (shared/notes/planner-anchors.md), i.e. most,
# not all, of it hidden.
ZERO_OVERLAP = 0.8
# A CPU device has no side streams: DeepSpeed's CPU accelerator returns None for Stream(), a no-op context
# for stream() and is_synchronized_device() True (deepspeed/accelerator/cpu_accelerator.py, 0.19.8), and gloo's
# collectives block, so every gather and reduction runs on the compute path. Measured on the CPU proxy
# (wall_clock_breakdown, 2 gloo ranks, reports/readme/cpu-proxy/README.md): ZeRO's reduction shows as its own serial
# `bwd_allreduce` time after the backward's compute.
ZERO_OVERLAP_CPU = 0.0
# Seconds each collective call costs beyond its bytes: Calculon's systems/h100_80g_nvl8.json
# (NVLink 10 us, InfiniBand 20 us).
LATENCY_S = {False: 10e-6, True: 20e-6}  # crosses nodes?
# Adam per trained parameter: fp32 master, exp_avg and exp_avg_sq read and written (24), the fp32
# gradient read (4), the compute-dtype parameter written back (2).
ADAM_BYTES_PER_PARAM = 30
# Share of a layer's forward-and-backward calls a recompute runs again: the forward's (full, op) or one
# block's (attn, mlp). An assumption: a layer's backward runs about as many calls as its forward, so a full
# recompute adds half. Op-level recompute runs the whole forward again too: torch's selective checkpoint
# dispatches every op and returns the saved ones from its cache. Counted in process (aten ops of a tiny Llama's
# step, tests/unit/memory/test_recompute_calls.py): op re-runs 0.61 of a layer's calls, full 0.60.
RECOMPUTE_CALLS = {"keep": 0.0, "full": 0.5, "op": 0.5}
RECOMPUTE_CALLS_PARTIAL = 0.25


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by term (each already multiplied out over the step's micro-steps)."""

    terms: dict[str, float] = field(default_factory=dict)
    # what the overhead term counts over the step: "layer_calls" (decoder layers' forward-and-backward calls,
    # recompute's share included), "collective_calls" (calls in groups of more than one rank), "steps" (1)
    counts: dict[str, float] = field(default_factory=dict)
    # bytes one rank sends over the intra-node link over the step (groups of more than one rank inside a node):
    # what `plan --verify` fits the link's seconds per byte to (overhead_fit.LINK); and their seconds at the
    # sheet's rate, in the terms above (hidden or not)
    intra_bytes: float = 0.0
    intra_s: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def binding(self) -> str:
        """The term that costs the most."""
        return max(self.terms, key=self.terms.get)


def zero_overlap(hw: Hardware) -> float:
    """The fraction of a micro-step's compute behind which ZeRO's side-stream collectives hide on `hw`'s device."""
    return ZERO_OVERLAP_CPU if hw.device == "cpu" else ZERO_OVERLAP


def collective_seconds(c: Collective, layout: Layout, hw: Hardware) -> float:
    n, _ = layout.group(c.group)
    if n <= 1:
        return 0.0
    across = layout.crosses_nodes(c.group)
    rate = hw.inter_bytes_per_s if across else hw.intra_bytes_per_s
    return c.sent(n) / rate + c.calls * LATENCY_S[across]


def optimizer_seconds(hw: Hardware, trained_per_rank: int, offload: bool, ranks_per_node: int) -> float:
    moved = ADAM_BYTES_PER_PARAM * trained_per_rank
    if offload:
        return moved * ranks_per_node / (hw.host_mem_bytes_per_s * hw.host_memory_efficiency)
    return moved / (hw.hbm_bytes_per_s * hw.hbm_efficiency)


def layer_calls(modes: tuple[str, ...]) -> float:
    """Decoder layers' forward-and-backward calls of one micro-step under per-layer modes (recompute's share)."""
    return sum(1.0 + RECOMPUTE_CALLS.get(m, RECOMPUTE_CALLS_PARTIAL) for m in modes)


def overhead_counts(layout: Layout, collectives: list[Collective], modes: tuple[str, ...], grad_accum: int) -> dict:
    """What the overhead term counts over one step (StepTime.counts)."""
    calls = sum(c.calls * (grad_accum if c.phase == MICRO else 1) for c in collectives if layout.group(c.group)[0] > 1)
    return {"layer_calls": grad_accum * layer_calls(modes), "collective_calls": float(calls), "steps": 1.0}


def intra_bytes(layout: Layout, collectives: list[Collective], grad_accum: int) -> float:
    """Bytes one rank sends over the step on links inside its node (StepTime.intra_bytes)."""
    total = 0.0
    for c in collectives:
        n, _ = layout.group(c.group)
        if n > 1 and not layout.crosses_nodes(c.group):
            total += c.sent(n) * (grad_accum if c.phase == MICRO else 1)
    return total


def overhead_seconds(hw: Hardware, counts: dict) -> float:
    return (hw.overhead_layer_s * counts["layer_calls"] + hw.overhead_collective_s * counts["collective_calls"]
            + hw.overhead_step_s * counts["steps"])


def step_time(hw: Hardware, layout: Layout, collectives: list[Collective], model_flops: float, ac_seconds: float,
              grad_accum: int, optimizer_s: float, host_copy_micro: float = 0.0, host_copy_step: float = 0.0,
              modes: tuple[str, ...] = ()) -> StepTime:
    """`model_flops` per micro-step on one rank; `ac_seconds` the per-layer solver's seconds per micro-step;
    `host_copy_*` bytes a rank copies over its host link per micro-step / per step; `modes` the layers' AC modes."""
    compute = model_flops / hw.flops_per_s
    per = {"zero": 0.0, "tp": 0.0, "sp": 0.0}
    stepwise = 0.0
    for c in collectives:
        s = collective_seconds(c, layout, hw)
        if c.phase == MICRO:
            per[c.group] += s
        else:
            stepwise += s
    counts = overhead_counts(layout, collectives, modes, grad_accum)
    sent = intra_bytes(layout, collectives, grad_accum)
    hidden = min(per["zero"], zero_overlap(hw) * compute)
    return StepTime({
        "compute": grad_accum * compute,
        "recompute": grad_accum * ac_seconds,
        "zero_comm": grad_accum * (per["zero"] - hidden) + stepwise,
        "tp_comm": grad_accum * per["tp"],
        "sp_comm": grad_accum * per["sp"],
        "offload_copies": (grad_accum * host_copy_micro + host_copy_step) / hw.host_bytes_per_s,
        "optimizer": optimizer_s,
        "overhead": overhead_seconds(hw, counts),
    }, counts, sent, sent / hw.intra_bytes_per_s)

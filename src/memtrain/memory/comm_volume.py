"""The collectives of one training step, with their exact byte volumes, for a configuration's parallel layout.

Per micro-step (each of the gradient-accumulation steps) and per optimizer step, per rank:

* ZeRO-3: an all-gather of every non-persistent parameter (the rank's TP shard) for each layer's
  forward and again for its backward. memtrain makes decoder layers ZeRO-3 leaf modules, so a
  recompute runs inside the backward's gather and fetches nothing more (memtrain.config.zero3).
  Where DeepSpeed's `stage3_max_reuse_distance` reaches over the whole trace (about 2 x the
  parameters), the forward's gather stays until the backward: one gather per micro-step (the rule
  memtrain.memory.states measured). Then a reduce-scatter of the trained gradients. No gather at
  all where nothing is sharded (one data-parallel rank: memtrain.config.zero3.resident). Once per step
  the updated persistent parameters are gathered whole again (DeepSpeed's stage3 `_post_step`).
* ZeRO-2: a reduce-scatter of the gradients every micro-step (overlap_comm reduces in the
  gradient hooks), and an all-gather of the updated parameters once per step. ZeRO-1 reduces its
  gradients once per step, at the accumulation boundary (counted on DeepSpeed 0.19.8's collectives,
  2 gloo ranks, gradient accumulation 2: one gradient's bytes per step under ZeRO-1, two under ZeRO-2).
  The all-gather moves the trained parameters only: frozen ones stay whole on every rank.
* ZeRO-0: an all-reduce of the gradients once per step (at the accumulation boundary).
* AutoTP: 2 all-reduces of (micro-batch x tokens x hidden) per layer forward (the row-parallel o and
  down projections' outputs) and 5 in the backward (the column-parallel q, k, v, gate and up
  projections each all-reduce their input's gradient: DeepSpeed 0.19.8's LinearLayer, counted on 2 gloo
  ranks); a recomputed forward repeats those it re-runs (full: 2, attn or mlp: 1). A sharded LM head
  gathers its logits in the forward (an uneven vocabulary padded to tp x the largest rank's rows) and
  all-reduces its input's gradient in the backward.
* Ulysses: per layer an all-to-all of q, k, v and the attention output in the forward and of their
  gradients in the backward; a recomputed attention (full, attn) repeats the forward's four.
  K/V heads fewer than the SP degree are repeated up to it before the exchange. Each attention's forward
  (a recomputed one again) all-gathers its int64 position ids over the group (DeepSpeed's UlyssesSPAttentionHF).

`bytes` is the collective's tensor: an all-gather's output, a reduce-scatter's input, an all-reduce's
buffer, an all-to-all's local buffer. What a rank sends over its link is `sent` (ring algorithms).
"""
from __future__ import annotations

from dataclasses import dataclass

MICRO, STEP = "micro", "step"  # per micro-step, once per optimizer step
_RECOMPUTED_TP = {"full": 2, "attn": 1, "mlp": 1}  # forward all-reduces a recomputed unit runs again
TP_FORWARD, TP_BACKWARD = 2, 5  # a Llama-like layer's row-parallel outputs; its column-parallel inputs' gradients
_RECOMPUTED_SP = {"full": 4, "attn": 4}  # forward all-to-alls (q, k, v, out) a recomputed attention runs again
POSITION_BYTES = 8  # Ulysses gathers each attention's int64 position ids over the SP group


@dataclass(frozen=True)
class Layout:
    """Where a configuration's ranks sit: TP innermost (consecutive ranks), then SP, then data parallel."""

    world: int
    gpus_per_node: int
    tp: int = 1
    sp: int = 1

    @property
    def dp(self) -> int:
        """Ranks that read different batches."""
        return self.world // (self.tp * self.sp)

    @property
    def zero(self) -> int:
        """Ranks ZeRO shards over (SP ranks included: DeepSpeed's sequence-data-parallel group)."""
        return self.world // self.tp

    def group(self, name: str) -> tuple[int, int]:
        """(size, stride) of the `tp`, `sp` or `zero` group of one rank."""
        return {"tp": (self.tp, 1), "sp": (self.sp, self.tp), "zero": (self.zero, self.tp)}[name]

    def crosses_nodes(self, name: str) -> bool:
        size, stride = self.group(name)
        return size > 1 and size * stride > self.gpus_per_node


@dataclass(frozen=True)
class ModelShape:
    """What the volumes need of a model on one TP rank (elements, not bytes)."""

    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    params: int  # one TP rank's parameters
    persistent: int  # ZeRO-3: elements at or under the persistence threshold (never gathered)
    trained: int  # elements with a gradient
    sharded_head: bool  # AutoTP shards the LM head (untied): its logits are gathered
    replicated: int = 0  # AutoTP: elements every TP rank holds whole (embeddings, norms; ActivationProfile.replicated)
    replicated_trained: int = 0  # of those, the elements with a gradient


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    group: str  # tp | sp | zero
    bytes: float  # the tensor of all its calls together (see the module doc)
    calls: int
    phase: str  # MICRO or STEP
    what: str

    def sent(self, n: int) -> float:
        """Bytes one rank sends over its link in a group of n (ring all-gather/reduce-scatter (n-1)/n,
        ring all-reduce 2(n-1)/n, all-to-all (n-1)/n of its buffer)."""
        if n <= 1:
            return 0.0
        return self.bytes * (n - 1) / n * (2 if self.kind == "all_reduce" else 1)


def zero_collectives(shape: ModelShape, stage: int, elem: int, layout: Layout, gathers_per_micro: int,
                     resident: bool) -> list[Collective]:
    """ZeRO's collectives: `gathers_per_micro` is 2 (forward and backward) or 1 (kept from forward to backward)."""
    if layout.zero <= 1:
        return []
    units = shape.layers + 1  # each decoder layer, and the modules around them (embeddings, norm, head)
    if stage == 3:
        out = []
        if not resident:
            out.append(Collective("all_gather", "zero", elem * (shape.params - shape.persistent) * gathers_per_micro,
                                  units * gathers_per_micro, MICRO, "ZeRO-3 parameter gathers"))
        out.append(Collective("reduce_scatter", "zero", elem * shape.trained, units, MICRO,
                              "ZeRO-3 gradient reduce-scatter"))
        if shape.persistent:  # DeepSpeed's _post_step re-gathers the updated persistent parameters, once a step
            out.append(Collective("all_gather", "zero", elem * shape.persistent, 1, STEP,
                                  "ZeRO-3 persistent parameters after the update"))
        return out
    if stage in (1, 2):
        return [Collective("reduce_scatter", "zero", elem * shape.trained, units, MICRO if stage == 2 else STEP,
                           f"ZeRO-{stage} gradient reduction"),
                Collective("all_gather", "zero", elem * shape.trained, 1, STEP, f"ZeRO-{stage} updated parameters")]
    return [Collective("all_reduce", "zero", elem * shape.trained, units, STEP, "ZeRO-0 gradient all-reduce")]


def replicated_collectives(shape: ModelShape, stage: int, elem: int, layout: Layout, gathers_per_micro: int,
                           resident: bool) -> list[Collective]:
    """ZeRO-3 under AutoTP with one data-parallel rank: the replicated parameters' reduce-scatter and gather.

    DeepSpeed 0.19.8 partitions a parameter under zero.Init over its data-parallel group, which defaults to every
    rank (partition_parameters.Init: no mpu yet), before AutoTP shards the layers; engine
    `_resolve_zero3_param_placement` keeps a parameter's partition group where zero.Init set it. So the
    replicated parameters are partitioned over the TP ranks too (memtrain.memory.states.replicated_split) and go
    through ZeRO-3's own paths over that group: their gradients reduce-scattered every micro-step
    (stage3 `__reduce_and_partition_ipg_grads` -> `reduce_scatter_fn`), and, where every parameter persists
    (memtrain.config.zero3.resident), gathered whole once a step after the update (stage3 `_post_step` ->
    `_allgather_params_coalesced`). Counted on 2 gloo CPU ranks, TP 2: 136,192 B each, exact. Not resident
    (offload_param): gathered with every fetch like any other partitioned parameter (not measured). With more
    data-parallel ranks `zero_collectives` already counts their bytes (the group is wider, the tensors the same).
    The same code runs on a GPU (NCCL; not measured on GPU)."""
    if stage != 3 or layout.tp <= 1 or layout.zero > 1 or not shape.replicated:
        return []
    out = [Collective("reduce_scatter", "tp", elem * shape.replicated_trained, shape.layers + 1, MICRO,
                      "ZeRO-3 replicated parameters' gradients (AutoTP)")] if shape.replicated_trained else []
    if resident:
        return out + [Collective("all_gather", "tp", elem * shape.replicated, 1, STEP,
                                 "ZeRO-3 replicated parameters after the update (AutoTP)")]
    return out + [Collective("all_gather", "tp", elem * shape.replicated * gathers_per_micro,
                             (shape.layers + 1) * gathers_per_micro, MICRO, "ZeRO-3 replicated parameter gathers (AutoTP)")]


def tp_collectives(shape: ModelShape, tokens: int, elem: int, modes: tuple[str, ...], layout: Layout) -> list[Collective]:
    """AutoTP's all-reduces for `tokens` (micro-batch x tokens per rank) under per-layer modes."""
    if layout.tp <= 1:
        return []
    act = elem * tokens * shape.hidden
    calls = (TP_FORWARD + TP_BACKWARD) * shape.layers + sum(_RECOMPUTED_TP.get(m, 0) for m in modes)
    out = [Collective("all_reduce", "tp", act * calls, calls, MICRO, "TP layer all-reduces")]
    if shape.sharded_head:  # an uneven vocabulary is gathered padded to tp x the largest rank's rows
        padded = -(-shape.vocab // layout.tp) * layout.tp
        out += [Collective("all_gather", "tp", elem * tokens * padded, 1, MICRO, "TP LM-head logits gather"),
                Collective("all_reduce", "tp", act, 1, MICRO, "TP LM-head input gradient")]
    return out


def sp_collectives(shape: ModelShape, tokens: int, elem: int, modes: tuple[str, ...], layout: Layout) -> list[Collective]:
    """Ulysses' all-to-alls for `tokens` (micro-batch x this rank's slice of the sequence)."""
    if layout.sp <= 1:
        return []
    kv = max(shape.kv_heads, layout.sp)
    per_layer = elem * tokens * shape.head_dim * (2 * shape.heads + 2 * kv)  # q, out; k, v
    runs = 2 * shape.layers + sum(_RECOMPUTED_SP.get(m, 0) for m in modes) // 4
    forwards = shape.layers + sum(_RECOMPUTED_SP.get(m, 0) for m in modes) // 4
    return [Collective("all_to_all", "sp", per_layer * runs, 4 * runs, MICRO, "Ulysses all-to-alls"),
            Collective("all_gather", "sp", POSITION_BYTES * tokens * layout.sp * forwards, forwards, MICRO,
                       "Ulysses position ids gather")]


def step_collectives(shape: ModelShape, stage: int, elem: int, layout: Layout, tokens: int, modes: tuple[str, ...],
                     gathers_per_micro: int = 2, resident: bool = False) -> list[Collective]:
    """Every collective of a step of this configuration (see the module doc)."""
    return (zero_collectives(shape, stage, elem, layout, gathers_per_micro, resident)
            + replicated_collectives(shape, stage, elem, layout, gathers_per_micro, resident)
            + tp_collectives(shape, tokens, elem, modes, layout) + sp_collectives(shape, tokens, elem, modes, layout))

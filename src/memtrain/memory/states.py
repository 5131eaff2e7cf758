"""Model states per device under DeepSpeed's layout: parameters, gradients, optimizer states, ZeRO buffers, offload."""
from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import torch

from memtrain.config.ds_config import get
from memtrain.config.zero3 import resident
from memtrain.memory.target import Target

if TYPE_CHECKING:  # a profile is measured after the states' formula is defined (memtrain.memory.profile)
    from memtrain.memory.profile import ActivationProfile


@dataclass(frozen=True)
class Release:
    """ZeRO-3 keeping every gathered parameter into the backward: what its backward has released again (bytes).

    DeepSpeed 0.19.8 frees a module's gathered parameters right after the module's backward
    (parameter_offload.py: post_sub_module_backward_function -> PartitionedParameterCoordinator.release_sub_module;
    __params_to_release keeps only a parameter used again within stage3_max_reuse_distance of the rest of the
    step's trace, and nothing is used again in the rest of a backward). The backward gathers nothing (every
    parameter is still whole), so no prefetch all-gather's flat buffer is alive either. `first`: released before
    the first layer's backward (the prefetch buffer); `per_layer`: each decoder layer's gathered parameters, gone
    once its backward is done.

    ZeRO-1/2 with gradient accumulation: `late`, the boundary's (ZeRO-1) or a later micro-step's (ZeRO-2) gradient
    partition (`ModelStates.accumulating`), is not made yet in the backward of the top `late_layers` layers
    (`accumulation_start`)."""

    first: int = 0
    per_layer: int = 0
    late: int = 0
    late_layers: int = 0

    def after(self, layers_done: int) -> int:
        """Bytes the backward does not hold (freed, or not made yet) once `layers_done` decoder layers (from the top)
        have run their backward."""
        return self.first + layers_done * self.per_layer + (self.late if layers_done < self.late_layers else 0)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per device for parameters, gradients and optimizer states, and what sits on the host."""

    params: int  # this rank's parameters (its partition under ZeRO-3)
    grads: int
    optimizer: int  # fp32 master copy and Adam's two moments
    buckets: int  # ZeRO-3's contiguous reduce bucket (allocated in full, whatever the model size)
    persistent: int  # ZeRO-3: parameters below the persistence threshold, also kept whole on every rank
    gathered: int  # ZeRO-3: the module being computed and the prefetch bucket, gathered in full
    update: int  # fp32 gradients made for the update (mixed precision; ZeRO-3: zero3_update); only during the step
    host: int  # offloaded to host memory (not part of the device peak)
    reduce_buckets: int = 0  # ZeRO-1/2 ipg reduce buckets: live from the first gradient to the end of the backward
    reduce_scratch: int = 0  # the flattened copy of one bucket while it is reduced (`reduction`; ZeRO-1/2 and -3)
    dequantized: int = 0  # a 4-bit base: the weight bitsandbytes dequantizes for one matmul (forward and backward)
    allreduce_copy: int = 0  # ZeRO-0: the flat copy of the gradients its all-reduce makes after the backward
    accumulated: int = 0  # gradient accumulation: gradients earlier micro-steps leave beyond `grads` (see accumulation)
    accumulating: int = 0  # gradient accumulation: what a later micro-step's backward adds beside them (backward only)
    buckets_held: bool = False  # ZeRO-1 with accumulation: no epilogue frees the reduce buckets between micro-steps
    release: Release = Release()  # what the backward does not hold yet or any more, by layer (Release)

    @property
    def without_activations(self) -> int:
        """The most held beside the states when no activation is alive: the optimizer step's fp32 gradients, or
        ZeRO-0's all-reduce copy at the accumulation boundary."""
        return max(self.update, self.allreduce_copy)

    @property
    def backward(self) -> int:
        """What exists through the backward beside every op (not in the forward or the update): the reduce buckets
        and a later micro-step's accumulation partition."""
        return (0 if self.buckets_held else self.reduce_buckets) + self.accumulating

    @property
    def reduction(self) -> int:
        """What exists only while a bucket is reduced: ZeRO-1/2's flatten copy, made and freed inside a gradient hook,
        between the backward's ops. It never meets an op's working set, so a backward phase holds the larger of the
        two (memory.predict, memory.planner). Traced on 2 gloo CPU ranks (DeepSpeed 0.19.8): at the peak, inside a
        layer's backward matmul, the buckets and the gradient partition were alive and the copy was not. The hook
        runs in the autograd thread between kernels on a GPU too (the copy on the reduction stream with
        overlap_comm: not measured on GPU)."""
        return self.reduce_scratch

    @property
    def backward_terms(self) -> tuple[int, int, Release]:
        """(backward, reduction, release): what a plan's backward depends on of the states (a cache key)."""
        return self.backward, self.reduction, self.release

    @property
    def total(self) -> int:
        """What is on the device through the forward and backward."""
        return self.params + self.grads + self.optimizer + self.buckets + self.persistent + self.gathered + \
            self.dequantized + self.accumulated + (self.reduce_buckets if self.buckets_held else 0)


ALLREDUCE_ELEMENTS = 500_000_000  # DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE: ZeRO-0's all-reduce bucket
QUANT_BLOCK = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights (Params4bit's default on CPU and CUDA)
NESTED_BLOCK = 256  # double quantization: the absmaxes quantized to 8 bits in blocks of 256, one fp32 scale each


def quantized_weight_bytes(numel: int, double_quant: bool) -> tuple[int, int]:
    """bitsandbytes' bytes for one 4-bit weight of `numel` elements: (the packed codes, its quant state).

    The codes: two a byte, whatever the storage dtype (quant_storage only reinterprets them). The quant state
    (bitsandbytes.functional.quantize_4bit): an fp32 absmax per block of 64 and the 16-entry fp32 code; with double
    quantization the absmaxes are uint8 instead, plus an fp32 scale per 256 of them, the 256-entry fp32 code of that
    8-bit quantization and an fp32 offset."""
    blocks = -(-numel // QUANT_BLOCK)
    state = 16 * 4
    if double_quant:
        state += blocks + 4 * -(-blocks // NESTED_BLOCK) + 256 * 4 + 4
    else:
        state += 4 * blocks
    return -(-numel // 2), state


def quantized_base(profile: "ActivationProfile", target: Target) -> tuple[int, int, int]:
    """A 4-bit base (model.quantization): (its 4-bit weights' elements, their packed bytes, their quant states'
    bytes); zeros without one."""
    if target.quantization is None:
        return 0, 0, 0
    elements = packed = state = 0
    for numel, count in profile.quantized_sizes:
        codes, extra = quantized_weight_bytes(numel, target.quantization.double_quant)
        elements, packed, state = elements + numel * count, packed + codes * count, state + extra * count
    return elements, packed, state


def persistent_elements(profile: "ActivationProfile", zero) -> int:
    """ZeRO-3: elements of the parameters at or under `stage3_param_persistence_threshold` (kept whole, never gathered)."""
    return sum(numel * count for numel, count in profile.param_sizes if numel <= zero.param_persistence_threshold)


def keeps_gathered(zero, params: int, world: int) -> bool:
    """ZeRO-3 keeps every gathered parameter from its forward to its backward when `stage3_max_reuse_distance`
    reaches over the whole trace (~2 x the parameters): see `model_states`."""
    return world > 1 and zero.max_reuse_distance >= 2 * params


def zero_config(ds_config: dict):
    """DeepSpeed's own parse of the JSON's zero_optimization section (its defaults filled)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: PLC0415 deepspeed: heavy, imported only when this runs

    return DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))


def model_states(profile: "ActivationProfile", ds_config: dict, target: Target, zero=None) -> ModelStates:
    """DeepSpeed's layout, component by component, with DeepSpeed's own defaults for its JSON.

    c = compute bytes per parameter (2 in bf16/fp16, 4 in fp32). Adam keeps two fp32 moments (8)
    beside an fp32 master copy (4; stages 1-3 keep one in fp32 training too, as measured on CPU).
    Stage >= 1 shards the optimizer, >= 2 the gradients, 3 the parameters. ZeRO-3's buffers:
    `zero3_buffers`; ZeRO-1/2's reduce buffers: `reduce_buffers`; gradient accumulation:
    `accumulation`; the optimizer offloaded: `offload_optimizer`.
    `zero`: `zero_config(ds_config)` where the caller parsed it already (default: parsed here).
    """
    zero = zero if zero is not None else zero_config(ds_config)
    # ZeRO shards over the data-parallel ranks; with TP, profile.num_params is already one rank's shard
    n, world, stage = profile.num_params, max(target.world_size // target.tp, 1), int(zero.stage)
    t = target.trained(n)  # frozen parameters (memtrain.model.freeze) have no gradient and no optimizer state
    split = replicated_split(profile, stage, target.tp)
    n, t = n - split, t - split
    c = torch.tensor([], dtype=target.torch_dtype).element_size()
    offload_opt = stage >= 1 and offloaded(zero.offload_optimizer)
    offload_param = stage == 3 and offloaded(zero.offload_param)
    mixed = c < 4

    # a 4-bit base: its linear weights two a byte (partitioned with the rest under ZeRO-3), their quant states whole on
    # every rank (not parameters: DeepSpeed never sees them); the rest in the compute dtype
    q, packed, quant_state = quantized_base(profile, target)
    params = (c * (n - q) + packed) // (world if stage == 3 else 1) + quant_state
    # ZeRO-1 with overlap_comm reduces in the gradient hooks as ZeRO-2 does, freeing each .grad once
    # it is in a bucket: only this rank's partition stays (measured, DeepSpeed 0.19.8, 2 ranks)
    grads = c * t // (world if stage >= 2 or (stage == 1 and zero.overlap_comm) else 1)
    optimizer = ((4 if stage >= 1 or mixed else 0) + 8) * t // (world if stage >= 1 else 1)  # the master copy, Adam's
    update = (zero3_update(profile, zero, c, t, world) if stage == 3 else 4 * t // (world if stage >= 1 else 1)) \
        if mixed else 0
    buckets, persistent, gathered, release = zero3_buffers(profile, ds_config, zero, c, world, q) if stage == 3 \
        else (0, 0, 0, Release())
    persistent += c * profile.replicated if split else 0  # the replicated parameters also kept whole
    reduce_buckets, reduce_scratch = reduce_buffers(profile, zero, c, world, offload_opt) if stage in (1, 2) else (0, 0)
    if stage == 3:
        reduce_scratch = zero3_reduction(profile, ds_config, zero, c, t, target)
    accumulated, accumulating, accumulated_host = accumulation(zero, stage, c, t, world, target.grad_accum, offload_opt)
    if accumulating:
        release = Release(late=accumulating, late_layers=accumulation_start(profile, zero))
    # ZeRO-0 (DeepSpeedEngine.allreduce_no_retain -> allreduce_bucket) flattens the gradients into one tensor of up
    # to 500,000,000 elements (MEMORY_OPT_ALLREDUCE_SIZE) per all-reduce, after the backward: measured on CPU in
    # fp32 (2 ranks, DeepSpeed 0.19.8). On a GPU the same code runs in fp32 and fp16; bf16 goes through DeepSpeed's
    # BF16_Optimizer (its fp32 gradient buffers), not measured. The engine all-reduces (and copies) whenever the
    # process group has more than one rank, one data-parallel rank under AutoTP included (measured: TP 2 on 2 ranks);
    # a single process is not measured.
    allreduce_copy = c * min(t, ALLREDUCE_ELEMENTS) if stage == 0 and target.world_size > 1 else 0
    host = 0
    if offload_opt:
        host, grads = offload_optimizer(profile, zero, stage, c, t, world, optimizer, grads)
        host += accumulated_host
        optimizer = update = 0
    if offload_param:
        host += params
        params = 0
    # bitsandbytes dequantizes a 4-bit weight whole in the compute dtype for each matmul (forward and backward)
    dequantized = c * max((numel for numel, _ in profile.quantized_sizes), default=0)
    return ModelStates(params, grads, optimizer, buckets, persistent, gathered, update, host,
                       reduce_buckets, reduce_scratch, dequantized, allreduce_copy, accumulated, accumulating,
                       buckets_held=stage == 1 and target.grad_accum > 1 and reduce_buckets > 0, release=release)


def replicated_split(profile: "ActivationProfile", stage: int, tp: int) -> int:
    """ZeRO-3 under AutoTP: the elements of the replicated parameters (profile.replicated: embeddings, norms) that
    one rank does not hold in its partition. DeepSpeed 0.19.8 partitions them over the TP ranks too, while the TP
    shards stay whole on a data-parallel rank of one, and keeps every replicated parameter whole beside its
    partition (`persistent`). So parameters, gradients, optimizer states and host bytes hold 1/tp of them.
    Measured on 2 gloo CPU ranks, TP 2 (one data-parallel rank): every term exact; with more data-parallel
    ranks not measured (the same 1/tp assumed, on top of ZeRO's own split). Not measured on GPU."""
    if stage != 3 or tp <= 1 or not profile.replicated:
        return 0
    return profile.replicated - -(-profile.replicated // tp)


def offloaded(section) -> bool:
    """Whether a ZeRO offload section moves its tensors off the device (to the host or NVMe)."""
    return section is not None and str(getattr(section.device, "value", section.device)) in ("cpu", "nvme")


def largest_param(profile: "ActivationProfile") -> int:
    """Elements of the largest parameter tensor."""
    return max((numel for numel, _ in profile.param_sizes), default=0)


def zero3_buffers(profile: "ActivationProfile", ds_config: dict, zero, c: int, world: int,
                  q: int) -> tuple[int, int, int, Release]:
    """ZeRO-3: (the contiguous reduce bucket, the persistent parameters kept whole, the gathered parameters, what the
    backward releases of them). `q`: a 4-bit base's elements."""
    n = profile.num_params
    buckets = c * zero.reduce_bucket_size if zero.contiguous_gradients else 0
    small = persistent_elements(profile, zero)
    persistent = c * small if world > 1 else 0  # in a world of one the partition is the parameter (measured)
    # the unit ZeRO-3 gathers at once is a whole decoder layer (memtrain.config.zero3 makes layers leaf
    # modules), plus the prefetch bucket
    gathered = c * (profile.largest_layer_params + min(zero.prefetch_bucket_size, n))
    if q:  # a layer's 4-bit weights gather at half a byte each
        gathered -= int((c - 0.5) * q / max(profile.num_layers, 1))
    release = Release()
    if resident(ds_config, world):  # memtrain.config.zero3: every parameter persists, nothing is gathered
        gathered = 0
    elif keeps_gathered(zero, n, world):
        # DeepSpeed releases a gathered parameter only if no use of it lies within
        # max_reuse_distance elements of the trace (forward and backward: ~2n); within reach, every
        # non-persistent parameter stays whole from its forward to its backward (measured, 2 ranks,
        # DeepSpeed 0.19.8). In a world of one the H100 calibration above holds (not re-measured).
        whole = c * (n - small) + prefetch_buffer(profile, zero, c, n - small)
        if whole > gathered:
            gathered = whole
            # a layer's own persistent parameters (its norms) are not released: the model's persistent elements shared
            # evenly over its layers (the final norm's counted in them: a few bytes less released)
            layer = profile.largest_layer_params - -(-small // max(profile.num_layers, 1))
            release = Release(prefetch_buffer(profile, zero, c, n - small), c * max(layer, 0) if not q else 0)
    return buckets, persistent, gathered, release


def zero3_update(profile: "ActivationProfile", zero, c: int, trained: int, world: int) -> int:
    """ZeRO-3 in mixed precision: what the optimizer step holds beside the states (`ModelStates.update`).

    DeepSpeed 0.19.8 (stage3.py step -> _prepare_fp32_grad_for_sub_group) updates one sub group at a time: it
    flattens the sub group's gradient partitions into one tensor in the compute dtype (torch.cat) and converts that
    to fp32, both alive at once (c + 4 bytes an element); the fp32 copy lives through the sub group's update and is
    freed after it (_release_sub_group), before the next sub group's. _create_fp16_sub_groups cuts the trained
    parameters in model order, closing a group on the parameter that takes it to sub_group_size partition elements:
    the largest group holds less than sub_group_size plus the largest parameter's partition, counted so (an upper
    bound), and at most the whole partition. One H100 (llama-1b, bf16, 2026-11-27): measured 64 MiB above the exact
    count (see reports/readme/gpu-h100-prediction.md). fp32 training (flatten's copy only, 4 bytes an element) is not
    counted: not measured."""
    partition = -(-trained // world)
    largest = -(-largest_param(profile) // world)
    return (c + 4) * min(partition, max(int(zero.sub_group_size), 1) + largest - 1)


def zero3_reduction(profile: "ActivationProfile", ds_config: dict, zero, c: int, trained: int, target: Target) -> int:
    """ZeRO-3: what exists only while a gradient bucket is reduced (`ModelStates.reduction`, between ops).

    DeepSpeed 0.19.8 (stage3.py __reduce_and_partition_ipg_grads -> __avg_scatter_grads ->
    comm/coalesced_collectives.reduce_scatter_coalesced): the bucket's gradients, each padded to the ranks, are
    flattened into one tensor (torch.cat), on every device. A bucket is reduced before a gradient would take it over
    reduce_bucket_size elements (__add_grad_to_ipg_bucket), so it holds at most that, or one larger parameter: counted
    so, an upper bound, or as `zero3_bucket` counts it where the order is known. gloo (CPU only) copies that flat
    tensor once more inside its reduce-scatter; NCCL reduces in place, so on a GPU the copy is counted once (not
    measured on GPU). Traced on 2 gloo CPU ranks, AutoTP 2: both
    copies (311,296 B each) alive at the peak, in the last layer's backward. ZeRO-3 reduces over every rank of its
    process group (AutoTP's one data-parallel rank included). A world of one is not measured: counted as none there
    (the one-GPU calibration in memory.predict was measured without the term)."""
    if target.world_size <= 1 or trained <= 0:
        return 0
    bucket = zero3_bucket(profile, ds_config, zero, target)
    flat = c * min(trained, bucket or max(int(zero.reduce_bucket_size), largest_param(profile)))
    return flat * (2 if target.device == "cpu" else 1)


def zero3_bucket(profile: "ActivationProfile", ds_config: dict, zero, target: Target) -> int:
    """ZeRO-3 under AutoTP with leaf layers: elements of the largest gradient bucket DeepSpeed reduces at once; 0
    where the order of the gradients is not known (the caller counts reduce_bucket_size).

    DeepSpeed 0.19.8 (stage3.py): a leaf layer's gradients are reduced together in its full-backward hook
    (create_reduce_and_remove_grad_hooks -> reduce_leaf_module_grads), in parameter order; a bucket is reduced before
    a gradient would take it over reduce_bucket_size elements, or where the partition group changes
    (reduce_independent_p_g_buckets_and_remove_grads). AutoTP's replicated parameters (the norms, the embedding) are
    partitioned over the TP ranks, the shards over the data-parallel ones: so each layer's shards make their own
    buckets, the LM head's shard its own, and the replicated ones theirs (at most all of them). Each gradient is
    padded to the group's ranks (reduce_scatter_coalesced); the replicated ones' padding (under tp elements each) is
    left out. Traced on 2 gloo CPU ranks, TP 2 (one data-parallel rank): 77,824 elements (q, k, v, o, gate, up), then
    22,528 (down), per layer. Without AutoTP one group takes gradients across layers, in an order the profile does
    not hold (autograd's without leaf layers): 0. Frozen weights: 0 (not traced). Not measured on GPU."""
    layer = [numel for numel, replicated in profile.layer_params if not replicated]
    leaf = get(ds_config, "zero_optimization.leaf_module") is not None
    if target.tp <= 1 or not leaf or not layer or target.trained(profile.num_params) != profile.num_params:
        return 0
    size, ranks = int(zero.reduce_bucket_size), max(target.world_size // target.tp, 1)
    padded = lambda numel: -(-numel // ranks) * ranks  # noqa: E731
    buckets, elements, held = [], 0, 0
    for numel in layer:
        if elements and elements + numel > size:
            buckets.append(held)
            elements = held = 0
        elements, held = elements + numel, held + padded(numel)
    buckets.append(held)
    most = max(size, largest_param(profile))  # a bucket of one larger gradient
    head = profile.num_params - profile.replicated - profile.num_layers * sum(layer)  # the LM head's shard
    return max(*buckets, padded(min(max(head, 0), most)), min(profile.replicated, most))


def prefetch_buffer(profile: "ActivationProfile", zero, c: int, gatherable: int) -> int:
    """ZeRO-3: the flat buffer of one prefetch all-gather, alive beside the parameters it gathered.

    DeepSpeed (partition_parameters.AllGatherCoalescedHandle, 0.19.8) gathers a prefetch bucket into one flat
    tensor and gives each parameter a copy of its slice (torch.cat) as it is waited for; the flat tensor lives
    until the bucket's last parameter is waited for. A bucket closes on the parameter that takes it to
    stage3_prefetch_bucket_size elements, so it holds less than that plus the largest parameter: counted so, an
    upper bound (measured 2 ranks on CPU: 492,032 B alive at the peak, a 123,008-element bucket of a 100,000
    one). The same code runs on a GPU (not measured on GPU)."""
    if zero.prefetch_bucket_size <= 0:
        return 0
    return c * min(int(zero.prefetch_bucket_size) + largest_param(profile), gatherable)


def reduce_buffers(profile: "ActivationProfile", zero, c: int, world: int, offload_opt: bool) -> tuple[int, int]:
    """ZeRO-1/2: (the ipg reduce buckets, the reduction's flatten copy).

    DeepSpeedZeroOptimizer.setup_buckets, at the first gradient hook of a backward, freed
    in its epilogue: with contiguous_gradients one ipg bucket of reduce_bucket_size elements per
    communication dtype, two with overlap_comm (double buffering); with more than one rank,
    reducing a bucket flattens its per-rank slices into one more tensor of up to the bucket's size
    (allreduce_and_scatter -> allreduce_bucket; in a world of one the slices merge into one and the
    flatten is a view: measured, nothing allocated); both in the
    compute dtype (DeepSpeed's default grad_accum_dtype). allgather_bucket_size allocates
    nothing: the parameters' all-gather writes into the flat parameter buffer
    (all_gather_into_tensor_dp_groups; the bucketed fallback gathers into narrowed views of it)."""
    g = c  # the gradient dtype (data_types.grad_accum_dtype apart from it is not modelled)
    buckets = scratch = 0
    if zero.contiguous_gradients or offload_opt:  # DeepSpeed turns contiguous gradients on for offload
        buckets = g * int(zero.reduce_bucket_size) * (2 if zero.overlap_comm else 1)
    if world > 1:  # in a world of one a bucket's slices merge into one view: nothing is copied
        scratch = g * min(profile.num_params, max(int(zero.reduce_bucket_size), largest_param(profile)))
    return buckets, scratch


def accumulation(zero, stage: int, c: int, t: int, world: int, accum: int,
                 offload_opt: bool) -> tuple[int, int, int]:
    """ZeRO-1/2 with gradient accumulation > 1: (gradients the earlier micro-steps leave on the device beyond `grads`,
    through the forward and backward; what only a later micro-step's backward adds; host bytes).

    DeepSpeed 0.19.8, stage_1_and_2.py. ZeRO-1 (partition_gradients False) reduces only at the accumulation
    boundary (reduce_ready_partitions_and_remove_grads): every .grad stays whole, accumulated in place, from the
    first micro-step's backward to its reduction in the boundary's; there the contiguous gradient partition
    (copy_grads_in_partition: grads_in_partition) is allocated at the first bucket's reduction, while the whole
    .grads are still held (offloaded: the partition goes to the host instead). Without overlap_comm `grads` already
    counts the whole .grads. ZeRO-2 reduces every micro-step: the epilogue keeps the reduced partition
    (all_grad_tensors) and frees grads_in_partition, so each later backward allocates a second partition at its
    first reduction and adds it into the first at its end. ZeRO-2 with the optimizer offloaded accumulates in a
    host buffer per parameter of its partition instead (accumulated_grads_in_cpu, kept for the run)."""
    if accum <= 1 or stage not in (1, 2):
        return 0, 0, 0
    partition = c * t // world
    if stage == 2:
        return (0, 0, partition) if offload_opt else (0, partition, 0)
    if not zero.overlap_comm:
        return 0, 0, 0
    if offload_opt:
        return c * t, 0, 0
    return c * t - partition, partition if zero.contiguous_gradients else 0, 0


def accumulation_start(profile: "ActivationProfile", zero) -> int:
    """ZeRO-1/2 with accumulation: how many layers (from the top) run their backward before the partition
    `accumulation` counts in the backward is made.

    DeepSpeed 0.19.8 makes it at the backward's first bucket reduction (copy_grads_in_partition from reduce_ipg_grads):
    once reduce_bucket_size gradient elements have come in, or at the epilogue. Traced on 2 gloo CPU ranks (ZeRO-1,
    micro-batch 2, accumulation 2, rank 1): the head's and layer 3's MLP gradients filled the first bucket inside
    layer 3's backward, after its transient's peak; the step's peak was in layer 2's backward, the partition alive.
    So a layer's backward holds it when the gradients before it reach a bucket. Those before the layers are counted
    as every parameter outside them, the embedding's included (its gradient comes last: an upper bound, it makes
    the partition sooner); at most every layer (the embedding's backward holds it). Not measured on GPU."""
    outside = profile.num_params - profile.num_layers * profile.largest_layer_params
    bucket = int(zero.reduce_bucket_size)
    if outside >= bucket or profile.largest_layer_params <= 0:
        return 0
    return min(profile.num_layers, -(-(bucket - outside) // profile.largest_layer_params))


def offload_optimizer(profile: "ActivationProfile", zero, stage: int, c: int, t: int, world: int, optimizer: int,
                      grads: int) -> tuple[int, int]:
    """The optimizer offloaded: (its host bytes, the gradients left on the device).

    The update runs on the host (measured, DeepSpeed 0.19.8, 2 ranks): the fp32 master and
    Adam's moments, the fp32 gradient partition it steps with (in fp32 training too), and a
    compute-dtype partition: ZeRO-1/2's bit16 buffer the update is copied back through, ZeRO-3's
    gradient partitions (on the offload device). ZeRO-1/2 stage each gradient through a buffer
    of the largest parameter's size on the device and one on the host."""
    host = optimizer + 4 * t // world + c * t // world
    if stage == 3:
        return host, 0
    # ZeRO-1 without overlap_comm keeps its full .grad until the backward's end (not measured)
    staging = c * largest_param(profile)
    return host + staging, (grads if stage == 1 and not zero.overlap_comm else 0) + staging

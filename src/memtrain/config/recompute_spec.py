"""RecomputeSpec: how activation checkpointing runs, decided once from the JSON, the recipe, the device and the layout.

Everything that needs the decision reads this one frozen object: the per-layer plan
(`memtrain.recompute.policy.build_plan`), the memory model and the planner, `make plan`,
`explain-config`, the hooks and DeepSpeed's own `checkpointing.configure` (`deepspeed_kwargs`).
Nothing else reads the JSON's `activation_checkpointing` section to decide what recompute does.

Who decides what:
* the JSON switches recompute on (it has an `activation_checkpointing` section) and asks for
  `partition_activations` / `cpu_checkpointing` (and DeepSpeed's own `contiguous_memory_optimization`,
  `number_checkpoints`, `synchronize_checkpoint_boundary`, `profile`);
* the recipe's `activation_checkpointing` section says where (policy, segments, modules, op_save) and how
  (backend, who offloads);
* the device and the tensor-parallel size decide which JSON keys have anything to do: partitioning
  shards across a tensor-parallel group, and offload moves accelerator memory to the host;
* ZeRO-3's layout (`memtrain.config.zero3`): where its hooks stay inside a recomputed unit, backend auto
  takes DeepSpeed's reentrant checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from memtrain.config.ac_policy import NO_POLICY, Policy
from memtrain.config.ds_config import ac_defaults, tp_size as json_tp_size
from memtrain.config.recipe import ACSection
from memtrain.config.zero3 import Zero3Layout, hooks_inside_layers, zero3_layout
from memtrain.errors import UserError

# Policies whose layers run op-level recompute (torch's selective checkpoint: non-reentrant only).
_OP_BASES = ("op",)


def effective_policy(section: ACSection, ds_config: dict) -> Policy:
    """The JSON switches AC on (its activation_checkpointing section); the recipe says where."""
    if "activation_checkpointing" in ds_config:
        return section.policy
    if "policy" in section.model_fields_set and section.policy.base != "none":
        raise UserError(f"activation_checkpointing.policy: '{section.policy}' needs an activation_checkpointing "
                        "section in the DeepSpeed JSON, which has none (use e.g. ds_configs/zero3_ckpt.json)")
    return NO_POLICY


def _json_section(cfg: dict) -> dict:
    """The JSON's activation_checkpointing section over DeepSpeed's defaults."""
    out = ac_defaults()
    section = cfg.get("activation_checkpointing") or {}
    for key, default in out.items():
        if key in section:
            out[key] = bool(section[key]) if isinstance(default, bool) else section[key]
    return out


@dataclass(frozen=True)
class RecomputeSpec:
    """The activation-checkpointing decision of one run (see the module docstring)."""

    ac_policy: Policy = NO_POLICY        # the effective policy (none without the JSON's section), as parsed
    requested_backend: str = "auto"      # the recipe's: auto | torch | deepspeed
    backend: str = "torch"               # the checkpoint that runs: torch | deepspeed
    partition_activations: bool = False  # takes effect: a tensor-parallel group and DeepSpeed's checkpoint
    cpu_checkpointing: bool = False      # takes effect: a GPU run offloads checkpointed inputs to the host
    offload_impl: str = "memtrain"       # who offloads: memtrain.recompute.offload or DeepSpeed's CPU_CHECKPOINT
    tp_size: int = 1
    device: str = "cuda"
    section: ACSection = field(default_factory=ACSection)  # the recipe's keys: segment_len, modules, op_save, ...
    contiguous_memory_optimization: bool = False  # DeepSpeed's own keys, passed to checkpointing.configure
    number_checkpoints: Any = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    notes: tuple[str, ...] = ()     # one plan line per JSON key that was asked for but has nothing to do here
    warnings: tuple[str, ...] = ()  # one line per setting that is ignored or costs more than it should
    ignored_by_torch: tuple[str, ...] = ()  # JSON keys set true that only DeepSpeed's checkpoint honours

    @property
    def policy(self) -> str:
        """The effective policy as the recipe spells it (messages, records)."""
        return self.ac_policy.text

    @property
    def op_level(self) -> bool:
        return self.ac_policy.base in _OP_BASES

    @property
    def deepspeed_offloads(self) -> bool:
        """DeepSpeed's own CPU_CHECKPOINT runs (otherwise memtrain's offload does, or none)."""
        return self.cpu_checkpointing and self.offload_impl == "deepspeed"

    def deepspeed_kwargs(self, number_checkpoints: Optional[int] = None) -> dict:
        """`deepspeed.checkpointing.configure`'s arguments: the spec's values, not a patched copy of the JSON
        (DeepSpeed's CPU_CHECKPOINT only when DeepSpeed offloads, partitioning only where it takes effect)."""
        n = number_checkpoints if number_checkpoints is not None else self.number_checkpoints
        return {"partition_activations": self.partition_activations,
                "contiguous_checkpointing": self.contiguous_memory_optimization,
                "num_checkpoints": n if isinstance(n, int) else None,
                "checkpoint_in_cpu": self.deepspeed_offloads,
                "synchronize": self.synchronize_checkpoint_boundary,
                "profile": self.profile}


def resolve_recompute(ds_config: dict, section: ACSection, device: str, tp_size: Optional[int] = None,
                      zero3_hooks_inside: bool = False) -> RecomputeSpec:
    """The run's RecomputeSpec. `ds_config` is the JSON (raw or resolved), `section` the recipe's
    activation_checkpointing, `device` "cuda" or "cpu", `tp_size` the tensor-parallel size (default: the
    JSON's tensor_parallel.autotp_size), and
    `zero3_hooks_inside` whether ZeRO-3 still hooks the submodules of a recomputed unit (no leaf layers:
    memtrain.config.zero3). Raises UserError (one line) for a combination that cannot run."""
    ac_policy = effective_policy(section, ds_config)
    policy = ac_policy.text
    tp_size = json_tp_size(ds_config) if tp_size is None else tp_size
    ds_ac = _json_section(ds_config)
    notes, warnings = [], []
    partition, offload = ds_ac["partition_activations"], ds_ac["cpu_checkpointing"]
    if partition and tp_size <= 1:
        partition = False
        notes.append("partition_activations: nothing to shard: no tensor-parallel group "
                     "(tensor_parallel.autotp_size is 1) to split checkpointed inputs across")
    if offload and device != "cuda":
        offload = False
        notes.append(f"cpu_checkpointing: a {device.upper()} run's activations are already in host memory: "
                     "no copies, no cost")
    requested = section.backend
    backend = requested if requested != "auto" else ("deepspeed" if partition or offload else "torch")
    if backend == "torch" and partition:
        warnings.append("backend 'torch' ignores the JSON's partition_activations")
    partition = partition and backend == "deepspeed"
    offload_impl = section.cpu_checkpointing_impl
    if partition and offload and offload_impl == "memtrain":
        # memtrain's offload moves whole inputs; with real partitioning DeepSpeed moves each rank's shard
        offload_impl = "deepspeed"
    if offload and offload_impl == "deepspeed" and backend != "deepspeed":
        raise UserError("activation_checkpointing.cpu_checkpointing_impl: 'deepspeed' offloads inside DeepSpeed's "
                        "checkpoint only; set activation_checkpointing.backend: deepspeed (or auto)")
    op_level = ac_policy.base in _OP_BASES
    if op_level and backend == "deepspeed":
        why = ("activation_checkpointing.backend is 'deepspeed'" if requested == "deepspeed" else
               "the DeepSpeed JSON asks for partition_activations/cpu_checkpointing, which selects DeepSpeed's "
               "reentrant checkpoint under backend 'auto'")
        raise UserError(f"activation_checkpointing.policy: '{policy}' (op-level) needs torch's non-reentrant "
                        f"checkpoint, but {why}; set activation_checkpointing.backend: torch or choose another policy")
    backend, deepspeed_reentrant = _backend_under_zero3_hooks(
        backend, section.deepspeed_reentrant, requested, op_level, zero3_hooks_inside and ac_policy.base != "none",
        notes, warnings)
    warnings.extend(_unused_key_warnings(section, ac_policy.base, policy))
    ignored = tuple(key for key in ("profile", "synchronize_checkpoint_boundary") if ds_ac.get(key)) \
        if backend == "torch" else ()
    return RecomputeSpec(
        ac_policy=ac_policy, requested_backend=requested, backend=backend, partition_activations=partition,
        cpu_checkpointing=offload, offload_impl=offload_impl, tp_size=tp_size, device=device,
        section=section.model_copy(update={"deepspeed_reentrant": deepspeed_reentrant}),
        contiguous_memory_optimization=bool(ds_ac["contiguous_memory_optimization"]),
        number_checkpoints=ds_ac["number_checkpoints"],
        synchronize_checkpoint_boundary=bool(ds_ac["synchronize_checkpoint_boundary"]),
        profile=bool(ds_ac["profile"]), notes=tuple(notes), warnings=tuple(warnings), ignored_by_torch=ignored)


def _backend_under_zero3_hooks(backend: str, reentrant: bool, requested: str, op_level: bool, hooks_inside: bool,
                               notes: list, warnings: list) -> tuple:
    """The (backend, deepspeed_reentrant) pair once ZeRO-3's hooks inside a recomputed unit are accounted for;
    appends the note or warning that says why to `notes` / `warnings`."""
    if not (hooks_inside and backend == "torch"):
        return backend, reentrant
    # torch's non-reentrant checkpoint stops a recompute once the backward has what it needs, skipping
    # the post-forward halves of ZeRO-3's hooks inside it, so DeepSpeed's module stack grows every step;
    # run to its end, the recompute would release parameters the backward still needs. DeepSpeed's
    # reentrant checkpoint backpropagates through the recomputed graph, whose hooks pair up.
    why = "ZeRO-3 hooks run inside each recompute (no leaf layers)"
    if requested == "auto" and not op_level:
        notes.append(f"backend: DeepSpeed's reentrant checkpoint: {why}, and torch's checkpoint would leave "
                     "their module stack unbalanced")
        return "deepspeed", True
    warnings.append(f"torch's checkpoint with {why}: each step leaves DeepSpeed's FWD_MODULE_STACK 2 entries "
                    "per recomputed layer longer; use backend deepspeed or let memtrain make the layers "
                    "ZeRO-3 leaf modules")
    return backend, reentrant


def _unused_key_warnings(section: ACSection, base: str, policy: str) -> list:
    """Warnings for the recipe's activation_checkpointing keys that the chosen policy does not read."""
    warnings = []
    if section.modules and base != "modules":
        warnings.append(f"activation_checkpointing.modules is ignored by policy '{policy}' (used by 'modules')")
    if section.segment_len and base != "sqrt":
        warnings.append(f"activation_checkpointing.segment_len is ignored by policy '{policy}' (used by 'sqrt')")
    return warnings


def resolve_with_layout(raw: dict, section: ACSection, device: str, layer_class: type, largest_param: int,
                        data_parallel_size: int) -> tuple[RecomputeSpec, Zero3Layout]:
    """A run's RecomputeSpec and ZeRO-3 layout, decided together (the one way every caller resolves them: the run's
    preflight, make plan, --max-seq and the OOM advice). The layout comes first: where ZeRO-3's hooks stay inside a
    recomputed layer, backend auto takes DeepSpeed's reentrant checkpoint. `raw` is the JSON, `layer_class` the
    model's decoder-layer class, `largest_param` its largest parameter's elements, over `data_parallel_size` ranks."""
    zero3 = zero3_layout(raw, layer_class, largest_param, data_parallel_size, segments=section.policy.base == "sqrt")
    spec = resolve_recompute(raw, section, device, json_tp_size(raw),
                             zero3_hooks_inside=hooks_inside_layers(raw, zero3, layer_class))
    return spec, zero3

"""Recompute plans: a `RecomputeSpec` and its parsed `Policy` become an `ACPlan`, one `LayerChoice` per decoder layer."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from memtrain.config.recipe import ACSection
from memtrain.config.ac_policy import CUSTOM, Policy, custom_policy, parse_policy as parse
from memtrain.config.recompute_spec import RecomputeSpec, resolve_recompute
from memtrain.errors import UserError
from memtrain.recompute.offload import PREFETCH_DEPTH, offload_flags, offload_units
from memtrain.recompute.partition import partition_line

KEEP, FULL, ATTN, MLP, OP = "keep", "full", "attn", "mlp", "op"
LAYER_MODES = (KEEP, FULL, ATTN, MLP, OP)
_MARKS = {KEEP: ".", FULL: "R", ATTN: "A", MLP: "M", OP: "O"}
_BASES = {"full": FULL, "sqrt": FULL, "op": OP, "selective:attn": ATTN, "selective:mlp": MLP}
# Attribute names of the attention / MLP sublayer across transformers decoder families.
SUBLAYER_NAMES = {ATTN: ("self_attn", "attn", "attention", "self_attention"),
              MLP: ("mlp", "feed_forward", "ffn", "block_sparse_moe")}
OP_GROUPS = {
    # MoE experts: torch's grouped matmul (bf16), or transformers' fallback op for other dtypes (model.moe)
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "transformers::grouped_mm_fallback"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_efficient_attention_forward"),
}


class LayerChoice(NamedTuple):
    """What one layer does: a mode (keep, full, attn, mlp, op; in a prediction also a measured `modules:` set) and
    whether its checkpointed input goes to the host. Printed as the mode, '+offload' added when offloaded
    ('full+offload'): the plan line, tables and JSON show it so."""

    mode: str
    offload: bool = False

    def __str__(self) -> str:
        return self.mode + ("+offload" if self.offload else "")


def as_choice(choice) -> LayerChoice:
    """A LayerChoice as it is, a plain mode string as that mode kept on the device."""
    return choice if isinstance(choice, LayerChoice) else LayerChoice(choice)


@dataclass(frozen=True)
class ACPlan:
    """What each decoder layer does in the backward, and how: the run's `RecomputeSpec` (backend, what the JSON's
    keys do, who offloads, the recipe's section) and one `LayerChoice` per layer.

    `layers[i]` is one of LAYER_MODES. `segments` are half-open layer ranges `(start, stop)` of
    `full` layers recomputed as one unit (only the segment's input is kept). `modules` are
    module-path patterns (relative to the model) recomputed in addition. `op_save` is the
    save list of mode `op` (see `op_context_fn`).
    """

    spec: RecomputeSpec
    choices: tuple[LayerChoice, ...]
    segments: tuple[tuple[int, int], ...] = ()
    checkpoint_input_bytes: Optional[int] = None  # one forward's checkpointed inputs per rank, unpartitioned

    @property
    def policy(self) -> str:
        return self.spec.policy

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(c.mode for c in self.choices)

    @property
    def offload(self) -> tuple[bool, ...]:
        """Per layer: the checkpoint call it makes sends its input to host."""
        return tuple(c.offload for c in self.choices)

    @property
    def backend(self) -> str:
        return self.spec.backend  # "torch" | "deepspeed"

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.spec.section.modules) if self.spec.ac_policy.base == "modules" else ()

    @property
    def op_save(self) -> tuple[str, ...]:
        return tuple(self.spec.section.op_save)

    @property
    def cpu_checkpointing(self) -> bool:
        return self.spec.cpu_checkpointing

    @property
    def partition_activations(self) -> bool:
        return self.spec.partition_activations

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.spec.warnings

    @property
    def notes(self) -> tuple[str, ...]:
        """One line per JSON key that was asked for but has nothing to do here."""
        return self.spec.notes

    @property
    def offload_impl(self) -> str:
        """Who offloads: memtrain.recompute.offload, or DeepSpeed's own CPU_CHECKPOINT."""
        return self.spec.offload_impl

    @property
    def offload_skip_last(self) -> int:
        """Policy 'modules': the last N matched modules keep their input on the device."""
        return self.spec.section.offload_skip_last

    @property
    def tp_size(self) -> int:
        """The tensor-parallel group partition_activations shards across (memtrain.train.parallel)."""
        return self.spec.tp_size

    @property
    def deepspeed_reentrant(self) -> bool:
        """Backend deepspeed: checkpoint (reentrant) or non_reentrant_checkpoint."""
        return self.spec.section.deepspeed_reentrant

    @property
    def memtrain_offload(self) -> bool:
        """memtrain.recompute.offload runs (and DeepSpeed's CPU_CHECKPOINT must not)."""
        return self.cpu_checkpointing and self.offload_impl == "memtrain" and (any(self.offload) or bool(self.modules))

    @property
    def offload_units(self) -> tuple[int, ...]:
        """The offload units, one per checkpoint call, each named by a layer (a recomputed layer, or a segment's
        first layer, whose input is the segment's):
        the units `offload` chooses among. Policy 'modules' has none here: its units are the
        matched modules, known once the plan meets the model (`apply_plan`)."""
        return offload_units([m != KEEP for m in self.layers], self.segments)

    def _units_text(self, units) -> tuple[str, str]:
        """(what this plan's units are, which of them `units` are) for the description,
        e.g. ('segments', 'heads of layers 0,4')."""
        heads = {start for start, _ in self.segments}
        csv = lambda idx: ",".join(map(str, idx))  # noqa: E731
        every = self.offload_units
        if every and all(i in heads for i in every):
            return "segments", f"heads of layers {csv(units)}"
        if not any(i in heads for i in every):
            return "recomputed layers", f"layers {csv(units)}"
        seg, single = [i for i in units if i in heads], [i for i in units if i not in heads]
        return "checkpointed units", "; ".join(
            ([f"segments at layers {csv(seg)}"] if seg else []) + ([f"layers {csv(single)}"] if single else []))

    def _describe_offload(self) -> list[str]:
        if not self.cpu_checkpointing:
            return ["cpu_checkpointing: off"]
        units = self.offload_units
        noun, _ = self._units_text(units)
        if self.offload_impl == "deepspeed":
            what = f"{len(units)} {noun}" if not self.modules else f"every module matching {', '.join(self.modules)}"
            why = ("each rank's partition (memtrain's offload moves whole inputs)"
                   if self.partition_activations and self.tp_size > 1 else
                   "activation_checkpointing.cpu_checkpointing_impl: deepspeed")
            return [f"cpu_checkpointing: on, DeepSpeed's own CPU_CHECKPOINT copies the input of every checkpoint call "
                    f"({what}) ({why})"]
        how = (f"(pinned host pool, side-stream copies, prefetch {PREFETCH_DEPTH} units ahead); "
               "DeepSpeed's own CPU_CHECKPOINT off")
        if self.modules:
            kept = self.offload_skip_last
            return [f"cpu_checkpointing: on, memtrain offload: inputs of the modules matching {', '.join(self.modules)} "
                    f"go to host memory" + (f", but the last {kept} in module order, which stay{'s' * (kept == 1)} on "
                                            "the device" if kept else "") + f" {how}"]
        flags = self.offload or (False,) * len(self.layers)
        host = [i for i in units if flags[i]]
        device = [i for i in units if not flags[i]]
        _, host_which = self._units_text(host)
        if not units:
            return ["cpu_checkpointing: on, but no layer is recomputed: nothing to offload"]
        if not device:
            stays = "none stays on the device"
        elif not host:
            stays = f"all {len(device)} stay on the device"
        elif device == list(units[len(units) - len(device):]):
            stays = f"the last {len(device)} stay{'s' * (len(device) == 1)} on the device"
        else:
            stays = f"{self._units_text(device)[1]} stay on the device"
        head = (f"cpu_checkpointing: on, memtrain offload: inputs of {len(host)} of {len(units)} {noun}"
                + (f" ({host_which})" if host else "") + f" go to host memory; {stays} {how}")
        starts = {s for s, _ in self.segments}
        stops = {e - 1 for _, e in self.segments}
        inside = {i for s, e in self.segments for i in range(s + 1, e)}
        marks = " ".join(("[" if i in starts else "")
                         + ("." if m == KEEP else "-" if i in inside else "H" if off else "D")
                         + ("]" if i in stops else "")
                         for i, (m, off) in enumerate(zip(self.layers, flags)))
        legend = "H = host, D = device, . = not recomputed" + (
            ", - = runs inside its segment's checkpoint; [...] = one segment" if self.segments else "")
        return [head, f"  checkpointed inputs ({legend}): {marks}"]

    def __post_init__(self) -> None:
        bad = sorted(set(self.layers) - set(LAYER_MODES))
        if bad:
            raise ValueError(f"ACPlan.layers: unknown modes {bad}; allowed: {LAYER_MODES}")
        if self.backend not in ("torch", "deepspeed"):
            raise ValueError(f"ACPlan.backend: {self.backend!r}")
        end = 0
        for start, stop in sorted(self.segments):
            if not (end <= start and stop - start >= 2 and stop <= len(self.layers)):
                raise ValueError(f"ACPlan.segments: {self.segments} must be disjoint ranges of >= 2 layers")
            if any(m != FULL for m in self.layers[start:stop]):
                raise ValueError(f"ACPlan.segments: layers {start}..{stop - 1} of a segment must all be '{FULL}'")
            end = stop
        if OP in self.layers and self.backend == "deepspeed":
            raise UserError(f"activation_checkpointing.policy: '{self.policy}' uses op-level recompute, which needs "
                            "torch's non-reentrant checkpoint, but the backend is deepspeed; "
                            "set activation_checkpointing.backend: torch or choose another policy")

    @property
    def num_recomputed(self) -> int:
        return sum(mode != KEEP for mode in self.layers)

    @property
    def checkpoint_calls(self) -> int:
        """Checkpoint calls per forward (DeepSpeed's number_checkpoints: contiguous_memory_optimization
        allocates one buffer per call), before the plan meets the model: one per recomputed layer or sqrt
        segment; policy 'modules' counts one per pattern and layer, and `recompute.hooks.checkpoint_calls`
        counts its real matches once the plan is installed."""
        return len(self.offload_units) + len(self.modules) * len(self.layers)

    def to_dict(self) -> dict:
        """The plan as config.json and summary.json show it."""
        return {"policy": self.policy, "layers": self.layers, "backend": self.backend, "segments": self.segments,
                "modules": self.modules, "op_save": self.op_save, "cpu_checkpointing": self.cpu_checkpointing,
                "partition_activations": self.partition_activations, "warnings": self.warnings, "notes": self.notes,
                "offload": self.offload, "offload_impl": self.offload_impl,
                "offload_skip_last": self.offload_skip_last, "tp_size": self.tp_size,
                "checkpoint_input_bytes": self.checkpoint_input_bytes,
                "deepspeed_reentrant": self.deepspeed_reentrant}

    def layer_marks(self) -> str:
        starts = {s for s, _ in self.segments}
        stops = {e - 1 for _, e in self.segments}
        return " ".join(("[" if i in starts else "") + _MARKS[m] + ("]" if i in stops else "")
                        for i, m in enumerate(self.layers))

    def describe(self) -> str:
        backend = {
            "torch": "torch.utils.checkpoint (non-reentrant)",
            "deepspeed": "deepspeed.checkpointing.checkpoint (reentrant)" if self.deepspeed_reentrant
            else "deepspeed.checkpointing.non_reentrant_checkpoint",
        }[self.backend]
        active = self.num_recomputed or self.modules
        lines = [
            f"AC plan: policy '{self.policy}', {self.num_recomputed}/{len(self.layers)} layers recomputed"
            + (f" with {backend}" if active else ""),
            "  layers (R = recompute, A = attention only, M = MLP only, O = op-level, . = keep; "
            f"[...] = one segment): {self.layer_marks()}",
        ]
        if OP in self.layers:
            lines.append(f"  op-level saves the outputs of: {', '.join(self.op_save)}")
        if self.modules:
            lines.append(f"  modules recomputed: {', '.join(self.modules)}")
        noted = {note.partition(":")[0] for note in self.notes}
        partition = ("partition_activations: on, checkpointed inputs are sharded across the tensor-parallel group"
                     if self.partition_activations else "partition_activations: off")
        offload = self._describe_offload()

        partitioned = partition_line(self, self.tp_size, self.checkpoint_input_bytes)
        lines += [f"  {line}" for line in self.notes]
        if partitioned:
            lines.append(f"  {partitioned}")
        elif "partition_activations" not in noted:
            lines.append(f"  {partition}")
        if "cpu_checkpointing" not in noted:
            lines += [f"  {offload[0]}"] + offload[1:]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------- policy -> plan

def policy_layers(policy: Policy, num_layers: int) -> tuple[str, ...]:
    """Per-layer modes of a parsed policy (memtrain.config.ac_policy): its base's mode where its selector picks."""
    if policy.base in ("auto", CUSTOM):
        raise UserError(f"activation_checkpointing.policy: '{policy}' has no fixed per-layer modes (auto: the "
                        "planner chooses them, memtrain.memory.planner)")
    mode = _BASES.get(policy.base, KEEP)
    return tuple(mode if chosen else KEEP for chosen in policy.selected(num_layers))


def layer_modes(policy: str, num_layers: int) -> tuple[str, ...]:
    """Per-layer modes for a policy string (parsed by memtrain.config.ac_policy)."""
    return policy_layers(parse(policy), num_layers)


def sqrt_segments(layers: tuple[str, ...], segment_len: Optional[int] = None) -> tuple[tuple[int, int], ...]:
    """Split the leading run of recomputed layers into segments of ~sqrt(n) layers (Chen et al. 2016)."""
    n = next((i for i, m in enumerate(layers) if m == KEEP), len(layers))
    k = segment_len or max(1, round(math.sqrt(n)))
    return tuple((s, min(s + k, n)) for s in range(0, n, k) if min(s + k, n) - s >= 2)


def build_plan(spec: RecomputeSpec, num_layers: int, layers: Optional[tuple[str, ...]] = None,
               offload: Optional[tuple[bool, ...]] = None) -> ACPlan:
    """The per-layer plan of a run's RecomputeSpec (memtrain.config.recompute_spec, which decided the backend,
    what the JSON's keys do and who offloads): the policy's mode for each of `num_layers` layers, its sqrt
    segments, modules and op save list. Policy 'auto' passes the planner's per-layer `layers` and `offload`."""
    policy, section = spec.ac_policy, spec.section
    is_sqrt = layers is None and policy.base == "sqrt"
    layers = tuple(layers) if layers is not None else policy_layers(policy, num_layers)
    modules = tuple(section.modules) if policy.base == "modules" else ()
    if policy.base == "modules":
        if not modules:
            raise UserError("activation_checkpointing.modules: policy 'modules' needs a list of module-path "
                            "patterns, e.g. [model.layers.*.mlp]")
        if any(not p.strip() for p in modules):
            raise UserError("activation_checkpointing.modules: empty pattern")
    op_save = tuple(section.op_save)
    if OP in layers:
        op_rules(op_save)  # validate early: a bad entry fails before any distributed work
    segments = sqrt_segments(layers, section.segment_len) if is_sqrt else ()
    if offload is None or not spec.cpu_checkpointing:
        offload = offload_flags([m != KEEP for m in layers], spec.cpu_checkpointing, section.offload_skip_last,
                                every=spec.offload_impl == "deepspeed", segments=segments)
    return ACPlan(spec, tuple(LayerChoice(m, bool(o)) for m, o in zip(layers, offload)), segments)


def custom_plan(layers, backend: str = "torch", modules=(), segments=(), policy: str = "custom") -> ACPlan:
    """A plan of given per-layer modes (tests, the activation profile): the recipe's defaults with `modules` (policy
    'modules' when there are any) on `backend`, nothing offloaded or partitioned."""
    policy = parse("modules") if modules else custom_policy(policy)
    section = ACSection(policy=policy, modules=list(modules))
    spec = RecomputeSpec(ac_policy=policy, requested_backend=backend, backend=backend, device="cpu", section=section)
    return ACPlan(spec, tuple(LayerChoice(m) for m in layers), tuple(segments))


def plan_for(policy: str, num_layers: int, section: Optional[ACSection] = None, ds_config: Optional[dict] = None,
             device: str = "cuda", tp_size: Optional[int] = None, **keys) -> ACPlan:
    """A plan outside a run (tools that compare policies, tests): `policy` with the recipe section `section`
    (default: the recipe's defaults) updated by `keys`, under the JSON `ds_config` (default: an
    activation_checkpointing section of DeepSpeed's defaults), resolved by the one RecomputeSpec."""
    section = (section or ACSection()).model_copy(update={"policy": parse(policy), **keys})
    spec = resolve_recompute({"activation_checkpointing": {}} if ds_config is None else ds_config, section, device,
                             tp_size)
    return build_plan(spec, num_layers)


# --------------------------------------------------------------------------- op-level (selective) recompute

def _resolve_ops(name: str, entry: str) -> frozenset:
    names = OP_GROUPS.get(name, (name.removeprefix("aten."),))
    ops = set()
    for qualified in names:
        namespace, _, qualified = qualified.rpartition("::")
        if namespace == "transformers":
            import transformers.integrations.moe  # noqa: F401, PLC0415 transformers: heavy, only here (registers its ops)
        packet_name, _, overload = qualified.partition(".")
        ops_of = getattr(torch.ops, namespace or "aten")
        packet = getattr(ops_of, packet_name, None) if packet_name.isidentifier() else None
        if packet is None:
            continue
        try:
            overloads = [overload] if overload else packet.overloads()
            ops.update(getattr(packet, o) for o in overloads)
        except AttributeError:
            continue
    if not ops:
        raise UserError(f"activation_checkpointing.op_save: unknown op '{entry}'; use matmul, attention "
                        "or an aten op name such as mul.Tensor, optionally with /N (every N-th call)")
    return frozenset(ops)


def draws_random(func, args, kwargs) -> bool:
    """Ops that consume the RNG must be recomputed so the recompute draws the same numbers in order."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" in names:  # attention kernels are tagged seeded but draw only with dropout on
        i = names.index("dropout_p")
        return float(kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)) > 0.0
    return True


def op_rules(entries) -> list[tuple[frozenset, int, bool]]:
    """`op_save` entries -> (ops, every, but_last): 'matmul', 'attention' or an aten op name; 'name/N' = every
    N-th call; 'name/but-last' = every call but the checkpointed unit's last (see DEFAULT_OP_SAVE)."""
    rules = []
    for entry in entries:
        name, sep, every = str(entry).strip().partition("/")
        but_last = every.strip() == "but-last"
        if sep and not but_last and (not every.isdigit() or int(every) <= 0):
            raise UserError(f"activation_checkpointing.op_save: '{entry}': expected name/N with N a positive integer, "
                            "or name/but-last")
        rules.append((_resolve_ops(name.strip(), entry), int(every) if sep and not but_last else 1, but_last))
    return rules



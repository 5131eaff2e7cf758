"""The units a plan recomputes, each recomputed or offloaded: the one list `apply_plan` installs and the predictor measures.

A unit is one checkpointed call: a decoder layer (modes full, op), its attention or MLP sublayer (attn, mlp), or a
module matched by policy 'modules' (full). `recompute_units` lists them from module paths alone, so the run (the real
model's paths, `model_units`) and the memory model (a one-layer model's paths repeated for every layer,
`memtrain.memory.predict`) read the same list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

from memtrain.errors import UserError
from memtrain.model.build import decoder_layers
from memtrain.recompute.policy import ATTN, FULL, KEEP, MLP, SUBLAYER_NAMES, ACPlan


@dataclass(frozen=True)
class RecomputeUnit:
    """One checkpointed call of a plan."""

    name: str  # module path in the model
    mode: str  # full | op | attn | mlp (a matched module: full)
    offload: bool  # its checkpointed input goes to host memory (memtrain's offload or DeepSpeed's CPU_CHECKPOINT)
    layer: Optional[int] = None  # the decoder layer it is in (None: outside the decoder layers)
    inside: str = ""  # its path inside that layer ('' = the layer)
    matched: bool = False  # matched by an activation_checkpointing.modules pattern (not by the per-layer modes)


@dataclass(frozen=True)
class ModelPaths:
    """What `recompute_units` reads of a model: its module paths in module order, the decoder-layer list's path and its
    layers."""

    names: tuple[str, ...]
    layer_path: str
    layers: tuple[LayerPaths, ...]
    model_type: str  # for messages: the model's class name


@dataclass(frozen=True)
class LayerPaths:
    """A decoder layer as `recompute_units` reads it: its class name, child names, and which children are its attention and
    MLP sublayers (None where it has none by a known name)."""

    layer_class: str
    children: tuple[str, ...]
    attn: Optional[str]
    mlp: Optional[str]

    def sublayer(self, mode: str) -> str:
        """The child name of its attention or MLP sublayer; one line naming its submodules if it has none."""
        found = self.attn if mode == ATTN else self.mlp
        if found is None:
            raise sublayer_error(self.layer_class, mode, self.children)
        return found


def module_pattern(text: str) -> re.Pattern:
    """An `activation_checkpointing.modules` pattern as a regex: '*' stands for one part of a module path."""
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in text.strip().split("*")) + "$")


def find_sublayer(layer: nn.Module, mode: str) -> Optional[nn.Module]:
    """The layer's attention (mode 'attn') or MLP ('mlp') sublayer, or None where it has none by a known name
    (OPT's MLP is fc1/fc2 directly on the layer)."""
    return next((getattr(layer, name) for name in SUBLAYER_NAMES[mode]
                 if isinstance(getattr(layer, name, None), nn.Module)), None)


def _sublayer_name(layer: nn.Module, mode: str) -> Optional[str]:
    return next((name for name in SUBLAYER_NAMES[mode] if isinstance(getattr(layer, name, None), nn.Module)), None)


def sublayer_error(layer_class: str, mode: str, children: Sequence[str]) -> UserError:
    return UserError(f"activation_checkpointing.policy: {layer_class} has no {mode} sublayer named "
                     f"{' / '.join(SUBLAYER_NAMES[mode])} (its submodules: {', '.join(children)}); every policy but "
                     f"selective:{mode} works, or policy 'modules' with module-path patterns of those")


def sublayer(layer: nn.Module, mode: str) -> nn.Module:
    """The layer's attention or MLP sublayer (`find_sublayer`); one line naming its submodules if it has none."""
    found = find_sublayer(layer, mode)
    if found is None:
        raise sublayer_error(type(layer).__name__, mode, [name for name, _ in layer.named_children()])
    return found


def model_paths(model: nn.Module) -> ModelPaths:
    """The paths `recompute_units` reads, of a real (or meta) model."""
    path, layers = decoder_layers(model)
    return ModelPaths(tuple(n for n, _ in model.named_modules() if n), path,
                      tuple(layer_paths(layer) for layer in layers), type(model).__name__)


def layer_paths(layer: nn.Module) -> LayerPaths:
    return LayerPaths(type(layer).__name__, tuple(name for name, _ in layer.named_children()),
                      _sublayer_name(layer, ATTN), _sublayer_name(layer, MLP))


def _layer_units(plan: ACPlan, paths: ModelPaths) -> list[RecomputeUnit]:
    units = []
    for i, mode in enumerate(plan.layers):
        if mode == KEEP:
            continue
        inside = paths.layers[i].sublayer(mode) if mode in (ATTN, MLP) else ""
        name = f"{paths.layer_path}.{i}" + (f".{inside}" if inside else "")
        offload = plan.cpu_checkpointing and i < len(plan.offload) and plan.offload[i]
        units.append(RecomputeUnit(name, mode, bool(offload), i, inside))
    return units


def _matches(plan: ACPlan, paths: ModelPaths) -> list[str]:
    """The modules the plan's patterns match, in pattern order, each once; one line for a pattern matching none."""
    hits = []
    for text in plan.modules:
        rx = module_pattern(text)
        found = [n for n in paths.names if rx.match(n)]
        if not found:
            examples = ", ".join(n for n in paths.names if re.search(r"\.0\.[^.]+$", n))[:160]
            raise UserError(f"activation_checkpointing.modules: '{text}' matches no module of "
                            f"{paths.model_type} ('*' is one path part; e.g. {examples})")
        hits += [n for n in found if n not in hits]
    return hits


def recompute_units(plan: ACPlan, paths: ModelPaths) -> tuple[list[RecomputeUnit], list[str]]:
    """The units `plan` recomputes on a model with these paths, in layer order then module order, and a line for each
    pattern match skipped because it overlaps (is inside or around) a module already recomputed. Raises UserError
    (one line) for a pattern that matches nothing or a sublayer a layer lacks."""
    if len(paths.layers) != len(plan.layers):
        raise ValueError(f"plan has {len(plan.layers)} layers, the model {len(paths.layers)}")
    units = _layer_units(plan, paths)
    taken = {u.name for u in units}
    skipped, matched = [], []
    for name in _matches(plan, paths):
        outer = next((t for t in taken if name.startswith(t + ".") or t.startswith(name + ".")), None)
        if outer is not None:
            skipped.append(f"activation_checkpointing.modules: '{name}' overlaps '{outer}', which is already "
                           "recomputed; skipped")
            continue
        taken.add(name)
        matched.append(name)
    order = {n: k for k, n in enumerate(paths.names)}
    matched.sort(key=order.__getitem__)
    # each matched module is one offload unit; the last `offload_skip_last` in module order (the forward's order in
    # a decoder) keep their input on the device; DeepSpeed's own CPU_CHECKPOINT copies every checkpoint call's input
    offloaded = max(len(matched) - plan.offload_skip_last, 0) if plan.memtrain_offload else \
        len(matched) if plan.cpu_checkpointing and plan.offload_impl == "deepspeed" else 0
    prefix = paths.layer_path + "."
    for k, name in enumerate(matched):
        index, _, inside = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        layer = int(index) if index.isdigit() else None
        units.append(RecomputeUnit(name, FULL, k < offloaded, layer, inside if layer is not None else "", True))
    return units, skipped


def model_units(model: nn.Module, plan: ACPlan) -> tuple[list[RecomputeUnit], list[str]]:
    """`recompute_units` on a real (or meta) model: what `apply_plan` installs there."""
    return recompute_units(plan, model_paths(model))

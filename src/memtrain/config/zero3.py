"""How ZeRO-3 holds the model's parameters: decoder layers as leaf modules, and residency where nothing is sharded.

Decided once, from the DeepSpeed JSON, the parallel layout and the model's shape (on the meta
device), and written into the resolved DeepSpeed config, where DeepSpeed's own mechanisms act on it:

* **Leaf layers.** Each decoder layer is a ZeRO-3 leaf module (`zero_optimization.leaf_module.classes`,
  DeepSpeed's own config, applied by `deepspeed.initialize`). ZeRO-3 then hooks the layer, not its
  ~12 submodules: the layer's parameters are gathered once for its forward and once for its
  backward, and a recompute, which runs the layer's `forward` inside the backward (transformers
  checkpoints `forward`, not `__call__`), runs no ZeRO-3 hook at all. Without it every hooked
  submodule fetches again inside the recompute, and torch's early stop of a recompute skips their
  post-forward hooks, which grows DeepSpeed's `FWD_MODULE_STACK` every step. A JSON that names
  leaf modules itself, or sets `stage3_module_granularity_threshold`, wins.
* **Residency.** With one data-parallel rank and no `offload_param`, ZeRO-3 has nothing to shard:
  every parameter persists (`stage3_param_persistence_threshold` at least the largest parameter),
  so no fetch or release moves or frees anything. The JSON still says stage 3 and the run still
  goes through ZeRO-3's engine (optimizer partitioning, gradient reduction, its checkpoint format).
  A JSON `stage3_param_persistence_threshold` of 0 (persist nothing) turns this off.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from memtrain.config.ds_config import get, offload_device, zero_stage

PERSISTENCE_KEY = "stage3_param_persistence_threshold"


@dataclass(frozen=True)
class Zero3Layout:
    """What memtrain sets in `zero_optimization` for a ZeRO-3 run, and one plan line per decision."""

    leaf_class: str = ""          # qualified class name of the decoder layer made a leaf ("" = none)
    persistence_threshold: int = 0  # > 0: parameters up to this many elements stay resident
    lines: tuple[str, ...] = ()

    @property
    def leaf_layers(self) -> bool:
        return bool(self.leaf_class)

    def apply(self, ds_config: dict) -> dict:
        """The resolved DeepSpeed config with these settings (a new dict; the input is unchanged)."""
        if not (self.leaf_class or self.persistence_threshold):
            return ds_config
        zero = dict(ds_config.get("zero_optimization", {}))
        if self.leaf_class:
            zero["leaf_module"] = {"classes": [self.leaf_class]}
        if self.persistence_threshold:
            zero[PERSISTENCE_KEY] = self.persistence_threshold
            zero["stage3_model_persistence_threshold"] = sys.maxsize
        return {**ds_config, "zero_optimization": zero}


def _user_leaf_setting(raw: dict) -> str:
    if get(raw, "zero_optimization.leaf_module") is not None:
        return "zero_optimization.leaf_module"
    threshold = get(raw, "zero_optimization.stage3_module_granularity_threshold", 0)
    if isinstance(threshold, (int, float)) and threshold > 0:
        return f"zero_optimization.stage3_module_granularity_threshold ({threshold:g})"
    return ""


def resident(raw: dict, data_parallel_size: int) -> bool:
    """ZeRO-3 keeps every parameter whole (nothing to shard): one data-parallel rank, no offload_param, and
    a JSON that does not turn persistence off (`stage3_param_persistence_threshold: 0`)."""
    return (zero_stage(raw) == 3 and data_parallel_size == 1 and offload_device(raw, "param") == "none"
            and get(raw, f"zero_optimization.{PERSISTENCE_KEY}") != 0)


def zero3_layout(raw: dict, layer_class: type, largest_param: int, data_parallel_size: int,
                 segments: bool = False) -> Zero3Layout:
    """The layout for a run of the JSON `raw` whose decoder layers are `layer_class` and whose largest
    parameter has `largest_param` elements, over `data_parallel_size` ranks that ZeRO shards across;
    `segments`: the AC plan recomputes sqrt segments (several layers in one checkpoint)."""
    if zero_stage(raw) != 3:
        return Zero3Layout()
    lines = []
    qualified = f"{layer_class.__module__}.{layer_class.__qualname__}"
    user = _user_leaf_setting(raw)
    if segments and not user:
        # A segment's layers run (and are recomputed) inside one checkpoint, through their own ZeRO-3
        # hooks; DeepSpeed's leaf-module gradient hook then fires for them twice.
        leaf = ""
        lines.append(f"zero3 leaf modules: none: sqrt segments run several {layer_class.__name__}s inside one "
                     "checkpoint, so ZeRO-3 keeps hooking each submodule (fetches repeat inside the recompute)")
    elif user:
        leaf = ""
        lines.append(f"zero3 leaf modules: the JSON's {user} decides (memtrain would make each "
                     f"{layer_class.__name__} a leaf: one parameter fetch per layer, none inside a recompute)")
    else:
        leaf = qualified
        lines.append(f"zero3 leaf modules: each {layer_class.__name__} (ZeRO-3 hooks the layer, not its submodules: "
                     "its parameters are gathered once per forward and once per backward, none inside a recompute)")
    threshold = 0
    if get(raw, f"zero_optimization.{PERSISTENCE_KEY}") == 0:
        lines.append(f"zero3 residency: off, the JSON's {PERSISTENCE_KEY} is 0 (no parameter persists)")
    elif resident(raw, data_parallel_size):
        threshold = int(largest_param)
        lines.append(f"zero3 residency: one data-parallel rank and no offload_param, so ZeRO-3 has nothing to shard: "
                     f"every parameter stays resident ({PERSISTENCE_KEY}: {threshold:,}, the largest parameter)")
    return Zero3Layout(leaf, threshold, tuple(lines))


def leaf_names_layer(raw: dict, layer_class: type) -> bool:
    """The JSON's own zero_optimization.leaf_module names the decoder-layer class (by name or qualified name)."""
    leaf = (raw.get("zero_optimization") or {}).get("leaf_module")
    classes = leaf.get("classes", []) if isinstance(leaf, dict) else []
    return any(c in (layer_class.__name__, f"{layer_class.__module__}.{layer_class.__qualname__}") for c in classes)


def hooks_inside_layers(raw: dict, layout: Zero3Layout, layer_class: type) -> bool:
    """ZeRO-3 hooks the submodules of each decoder layer, so its hooks run inside a layer's recompute: stage 3, and
    neither memtrain's leaf layers (`layout`) nor the JSON's own leaf_module makes the layer a leaf."""
    return zero_stage(raw) == 3 and not layout.leaf_layers and not leaf_names_layer(raw, layer_class)

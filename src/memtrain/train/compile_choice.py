"""Whether a run compiles its decoder layers (`train.compile`), and one line for what cannot compose with it."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.torch_version import TorchVersion

from memtrain.errors import UserError
from memtrain.recompute.policy import ATTN, MLP, ACPlan

GPU_CHECK_DIR = Path("reports/gpu")  # where `make gpu-check` writes <device>.json (from the directory it runs in)
COMPILED_PREDICTION = ("train.compile: predicted for compiled layers: what each layer's compiled forward saves, as "
                       "inductor's partitioner splits it (measured on fake tensors); the run's compile line measures it")
EAGER_AUTO_PLAN = ("train.compile: policy auto chose its layers for eager layers (train.compile auto is decided after "
                   "the plan); the peak is predicted for compiled ones")


@dataclass(frozen=True)
class CompileChoice:
    on: bool = False
    line: str = ""  # the plan line ("" when train.compile is false)


def choose_compile(asked, plan: ACPlan, device: str, tp: int = 1, sequence: int = 1, hooks_inside: bool = False,
                   reports: Path = GPU_CHECK_DIR, gpu: Optional[str] = None, sharded: bool = False) -> CompileChoice:
    """train.compile (false | true | auto) for this run. true: a UserError naming the key where it cannot compose;
    auto: off where it cannot, or where `make gpu-check` did not measure it faster on this device. `hooks_inside`:
    ZeRO-3 hooks the decoder layers' submodules (no leaf layers). `sharded`: ZeRO-3 partitions the parameters (they
    are gathered per layer, not resident). `gpu`: the device's name (default: CUDA's), read for auto only."""
    if asked is False:
        return CompileChoice()
    why = ""
    if asked == "auto":
        faster, why = measured_faster(plan.policy, device, gpu if gpu is not None else device_name(device), reports)
        if faster:
            try:
                check_composes(plan, tp, sequence, hooks_inside, sharded)
            except UserError as e:
                faster, why = False, str(e).removeprefix("train.compile: true cannot be combined with ")
                why = f"it cannot be combined with {why}"
        if not faster:
            return CompileChoice(False, f"compile: off (train.compile auto: {why})")
        why = f" (train.compile auto: {why})"
    check_composes(plan, tp, sequence, hooks_inside, sharded)
    how = "recompute traced inside (torchtitan's order)" if plan.backend == "torch" else \
        "inside DeepSpeed's eager checkpoint"
    return CompileChoice(True, f"compile: each decoder layer's forward under torch.compile, {how}{why}; memory is "
                               "predicted for compiled layers, and measured after the warm-up")


def keeps_gathered_weights(version: Optional[str] = None) -> bool:
    """Whether this torch's compiled layers keep ZeRO-3's gathered weights until the backward: torch 2.11's dynamo
    saves the weights DeepSpeed's patched F.linear saves as plain tensors, not as the parameters, so ZeRO-3's release
    after the layer's forward frees nothing (measured on 2 gloo ranks: 1.445 MiB kept against eager's 0.277 MiB,
    the difference the layers' weight matrices). torch 2.13 saves the parameters themselves."""
    return TorchVersion(version or torch.__version__) < (2, 13)


def check_composes(plan: ACPlan, tp: int, sequence: int, hooks_inside: bool = False, sharded: bool = False) -> None:
    """One line for each set-up train.compile does not run (each named by its key). `hooks_inside`: ZeRO-3 hooks
    the decoder layers' submodules (no leaf layers), so its hooks would run inside the compiled layers. `sharded`:
    ZeRO-3 gathers each layer's parameters for its forward and releases them after."""
    no = "train.compile: true cannot be combined with"
    if sharded and keeps_gathered_weights():
        raise UserError(f"{no} ZeRO-3's sharded parameters on torch {torch.__version__}: its compiled layers keep "
                        "every layer's gathered weights until the backward, which undoes the sharding; use torch "
                        ">= 2.13, or train.compile: false (with one data-parallel rank, memtrain keeps parameters "
                        "resident and compiling is allowed)")
    if hooks_inside and plan.segments:
        raise UserError(f"{no} activation_checkpointing.policy '{plan.policy}' under ZeRO-3: a sqrt segment recomputes "
                        "several layers in one checkpoint, so ZeRO-3 hooks their submodules (no leaf layers), and "
                        "those hooks would run inside the compiled layers; use full, every:K or op")
    if hooks_inside:
        raise UserError(f"{no} the JSON's zero_optimization.leaf_module / stage3_module_granularity_threshold: they "
                        "leave ZeRO-3's hooks on the decoder layers' submodules, inside what would be compiled; drop "
                        "them (memtrain then makes each decoder layer a leaf module)")
    if plan.modules:
        raise UserError(f"{no} activation_checkpointing.policy 'modules' (its modules need not sit inside a decoder "
                        "layer, the unit that is compiled); use a per-layer policy, or train.compile: false")
    sub = [i for i, mode in enumerate(plan.layers) if mode in (ATTN, MLP)]
    if sub and plan.backend == "deepspeed":
        raise UserError(f"{no} a recomputed sublayer (policy '{plan.policy}') on activation_checkpointing.backend "
                        "deepspeed: DeepSpeed's checkpoint cannot be traced inside the compiled layer; use backend torch")
    if sub and plan.memtrain_offload and any(plan.offload[i] for i in sub):
        raise UserError(f"{no} cpu_checkpointing of a recomputed sublayer (policy '{plan.policy}'): the offload "
                        "hooks cannot run inside the compiled layer; recompute whole layers (full, op) to offload")
    if tp > 1:
        raise UserError(f"{no} tensor_parallel.autotp_size {tp}: AutoTP's layers all-reduce inside the decoder "
                        "layer through deepspeed.comm, which torch.compile does not trace")
    if sequence > 1:
        raise UserError(f"{no} parallel.sequence {sequence}: Ulysses' all-to-all runs inside the decoder layer's "
                        "attention through deepspeed.comm, which torch.compile does not trace")


def device_slug(name: str) -> str:
    """A device name as a file name (`make gpu-check`'s reports/gpu/<slug>.json)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def measured_faster(policy: str, device: str, device_name: str, reports: Path = GPU_CHECK_DIR) -> tuple[bool, str]:
    """train.compile auto: whether this device's `make gpu-check` measured the compiled set-ups faster than the same
    set-ups eager (the one with this run's policy where it ran, else all of them), and why not."""
    if device != "cuda":
        return False, "off on CPU"
    path = reports / f"{device_slug(device_name)}.json"
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, f"no make gpu-check figures for {device_name} in {path}"
    speed = {r["setup"]: r["tokens_per_s"] for r in results if isinstance(r, dict) and r.get("tokens_per_s")}
    pairs = {name.removeprefix("memtrain:").removesuffix("+compile"): (speed.get(name.removesuffix("+compile")),
                                                                       speed[name])
             for name in speed if name.endswith("+compile")}
    pairs = {base: pair for base, pair in pairs.items() if pair[0]}
    if not pairs:
        return False, f"{path} has no compiled set-up measured beside its eager one"
    own = {base: pair for base, pair in pairs.items() if base.partition("+")[0] == policy}
    chosen = own or pairs
    ratios = ", ".join(f"{base} {c / e:.2f}x" for base, (e, c) in chosen.items())
    if any(c <= e for e, c in chosen.values()):
        return False, f"make gpu-check measured compiled vs eager on {device_name}: {ratios}, not all faster"
    return True, f"make gpu-check measured compiled vs eager on {device_name}: {ratios}"


def device_name(device: str) -> str:
    if device != "cuda":
        return ""

    return torch.cuda.get_device_name()

"""The set-ups the benchmark compares, named on the command line.

* `torch:noac`: plain PyTorch, no activation checkpointing (the baseline every ratio uses);
* `torch:hf-ac`: plain PyTorch with transformers' `gradient_checkpointing_enable(use_reentrant=False)`;
* `torch:sac`: plain PyTorch with torch's op-level selective checkpoint per layer (saves matmul
  and attention outputs, recomputes the rest: memtrain's `op` policy on the torch backend);
* `deepspeed:cpu-ckpt`: ZeRO-3, `deepspeed.checkpointing.checkpoint` per layer with DeepSpeed's own
  `cpu_checkpointing` (the JSON switch with `cpu_checkpointing_impl: deepspeed`);
* `memtrain:<policy>[+offload][@torch|@deepspeed]`: ZeRO-3 with a memtrain policy (`full`,
  `every:2`, `op`, ...); `+offload` turns on the JSON's `cpu_checkpointing`, which runs memtrain's
  offload; `@` picks the checkpoint backend (default deepspeed, the faster of the two in the
  CEO's H100 table).

Plain PyTorch set-ups keep float32 master weights under bf16 autocast (when the GPU has bf16)
with fused AdamW; ZeRO-3 set-ups use the DeepSpeed JSON (`ds_configs/zero3_ckpt.json` unless
`--deepspeed` names another), whose `"auto"` bf16 turns on where supported.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

DEFAULT_SETUPS = ("torch:noac", "torch:hf-ac", "torch:sac", "deepspeed:cpu-ckpt", "memtrain:full",
                  "memtrain:full+offload")
BASELINE = "torch:noac"
_PLAIN = {"noac": "no activation checkpointing", "hf-ac": "transformers gradient_checkpointing_enable",
          "sac": "torch selective AC (save matmul + attention)"}
HELP = "torch:noac | torch:hf-ac | torch:sac | deepspeed:cpu-ckpt | memtrain:<policy>[+offload][@torch|@deepspeed]"


@dataclass(frozen=True)
class Setup:
    name: str
    zero3: bool          # ZeRO-3 through DeepSpeed, else plain PyTorch
    ac: str              # plain: noac | hf-ac | sac; ZeRO-3: a memtrain policy
    backend: str = "deepspeed"
    cpu_checkpointing: bool = False
    impl: str = "memtrain"  # who offloads when cpu_checkpointing is on

    @property
    def label(self) -> str:
        if not self.zero3:
            return f"PyTorch, {_PLAIN[self.ac]}"
        if self.impl == "deepspeed":
            return "ZeRO-3, DeepSpeed checkpoint + DeepSpeed's own cpu_checkpointing"
        offload = ", memtrain offload" if self.cpu_checkpointing else ""
        return f"ZeRO-3, memtrain '{self.ac}' ({self.backend} checkpoint){offload}"


def parse_setup(name: str) -> Setup:
    kind, sep, rest = name.strip().partition(":")
    if kind == "torch" and rest in _PLAIN:
        return Setup(name, zero3=False, ac=rest, backend="torch")
    if kind == "deepspeed" and rest == "cpu-ckpt":
        return Setup(name, zero3=True, ac="full", cpu_checkpointing=True, impl="deepspeed")
    if kind == "memtrain" and rest:
        policy, at, backend = rest.rpartition("@") if "@" in rest else (rest, "", "deepspeed")
        offload = policy.endswith("+offload")
        policy = policy.removesuffix("+offload")
        if policy and backend in ("torch", "deepspeed"):
            return Setup(name, zero3=True, ac=policy, backend=backend, cpu_checkpointing=offload)
    raise UserError(f"--setups: unknown set-up '{name}'; allowed: {HELP}")

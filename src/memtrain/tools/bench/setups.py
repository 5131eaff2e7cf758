"""The set-ups the benchmark compares, named on the command line.

* `torch:noac`: plain PyTorch, no activation checkpointing (the baseline every ratio uses);
* `torch:hf-ac`: plain PyTorch with transformers' `gradient_checkpointing_enable(use_reentrant=False)`;
* `torch:sac`: plain PyTorch with torch's op-level selective checkpoint per layer (saves matmul
  and attention outputs, recomputes the rest: memtrain's `op` policy on the torch backend);
* `deepspeed:cpu-ckpt`: ZeRO-3, `deepspeed.checkpointing.checkpoint` per layer with DeepSpeed's own
  `cpu_checkpointing` (the JSON switch with `cpu_checkpointing_impl: deepspeed`);
* `memtrain:<policy>[+offload][@torch|@deepspeed][+compile][-leaf][-resident]`: the trainer (`src/train.py`, the
  same code a training run executes) with a memtrain policy (`none`, `full`, `every:2`, `op`, `auto`,
  ...); `+offload` turns on the JSON's `cpu_checkpointing`, which runs memtrain's offload; `@` forces
  the checkpoint backend (default: the recipe's, normally `auto`); `+compile` sets `train.compile: true`
  (each layer under torch.compile, memtrain.recompute.compiled). `-leaf` keeps ZeRO-3's hooks on
  every submodule (the JSON names no leaf module) and `-resident` turns one-rank residency off (the
  JSON's persistence threshold is 0): the set-ups as they ran before memtrain.config.zero3. A last `+lora` trains
  LoRA adapters (r 16 on every linear layer) on the frozen base, `+qlora` the same on a 4-bit NF4 base
  (`model.quantization`; under ZeRO-3 its codes are stored in the dtype DeepSpeed computes in).

Plain PyTorch set-ups (`bench/plain.py`) keep float32 master weights under bf16 autocast (when
the GPU has bf16) with fused AdamW; the others run the trainer on the DeepSpeed JSON
(`ds_configs/zero3_ckpt.json` unless `--deepspeed` names another), whose `"auto"` bf16 turns
on where supported.
"""
from __future__ import annotations

from dataclasses import dataclass

from memtrain.errors import UserError

DEFAULT_SETUPS = ("torch:noac", "torch:hf-ac", "torch:sac", "deepspeed:cpu-ckpt", "memtrain:full",
                  "memtrain:full+offload")
BASELINE = "torch:noac"
_PLAIN = {"noac": "no activation checkpointing", "hf-ac": "transformers gradient_checkpointing_enable",
          "sac": "torch selective AC (save matmul + attention)"}
HELP = ("torch:noac | torch:hf-ac | torch:sac | deepspeed:cpu-ckpt | "
        "memtrain:<policy>[+offload][@torch|@deepspeed][+compile][-leaf][-resident][+lora|+qlora]")
# the recipe keys each adapter set-up adds (memtrain.model.lora, memtrain.model.quantize)
ADAPTERS = {"": (), "lora": ("model.lora.r=16", "model.lora.alpha=32", "model.lora.target_modules=all-linear")}
ADAPTERS["qlora"] = (*ADAPTERS["lora"], "model.quantization.type=nf4")


@dataclass(frozen=True)
class Setup:
    name: str
    trainer: bool        # the trainer (src/train.py), else the plain-PyTorch baseline
    ac: str              # plain: noac | hf-ac | sac; ZeRO-3: a memtrain policy
    backend: str = "auto"
    cpu_checkpointing: bool = False
    impl: str = "memtrain"  # who offloads when cpu_checkpointing is on
    leaf: bool = True       # memtrain's ZeRO-3 leaf layers (memtrain.config.zero3)
    resident: bool = True   # memtrain's one-rank residency
    compiled: bool = False  # train.compile: true
    adapters: str = ""      # "" (every weight trains), "lora" or "qlora" (ADAPTERS)

    @property
    def label(self) -> str:
        if not self.trainer:
            return f"PyTorch, {_PLAIN[self.ac]}"
        if self.impl == "deepspeed":
            return "ZeRO-3, DeepSpeed checkpoint + DeepSpeed's own cpu_checkpointing"
        offload = ", memtrain offload" if self.cpu_checkpointing else ""
        backend = "" if self.backend == "auto" else f" ({self.backend} checkpoint)"
        zero3 = [what for what, on in (("no leaf layers", self.leaf), ("not resident", self.resident)) if not on]
        compiled = ", compiled" if self.compiled else ""
        adapters = {"": "", "lora": ", LoRA", "qlora": ", QLoRA (4-bit NF4 base)"}[self.adapters]
        return f"trainer, policy '{self.ac}'{backend}{offload}{compiled}{adapters}" + "".join(f", {z}" for z in zero3)


def parse_setup(name: str) -> Setup:
    kind, sep, rest = name.strip().partition(":")
    if kind == "torch" and rest in _PLAIN:
        return Setup(name, trainer=False, ac=rest, backend="torch")
    if kind == "deepspeed" and rest == "cpu-ckpt":
        return Setup(name, trainer=True, ac="full", cpu_checkpointing=True, impl="deepspeed")
    if kind == "memtrain" and rest:
        flags = {"adapters": next((a for a in ("qlora", "lora") if rest.endswith(f"+{a}")), "")}
        rest = rest.removesuffix(f"+{flags['adapters']}") if flags["adapters"] else rest
        for flag in ("resident", "leaf"):
            flags[flag] = not rest.endswith(f"-{flag}")
            rest = rest.removesuffix(f"-{flag}")
        flags["compiled"] = rest.endswith("+compile")
        rest = rest.removesuffix("+compile")
        policy, at, backend = rest.rpartition("@") if "@" in rest else (rest, "", "auto")
        offload = policy.endswith("+offload")
        policy = policy.removesuffix("+offload")
        if policy and backend in ("auto", "torch", "deepspeed"):
            return Setup(name, trainer=True, ac=policy, backend=backend, cpu_checkpointing=offload, **flags)
    raise UserError(f"--setups: unknown set-up '{name}'; allowed: {HELP}")

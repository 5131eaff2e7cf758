"""The run a memory prediction is for (one device): shapes, dtype, layout, what trains, and the recipe's config."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from memtrain.config.ds_config import AUTO, tp_size as json_tp_size
from memtrain.config.recipe import LoraSection, QuantizationSection
from memtrain.config.recompute_spec import RecomputeSpec, resolve_with_layout
from memtrain.config.zero3 import Zero3Layout
from memtrain.model.build import build_config, build_on_meta, decoder_layers
from memtrain.model.data import build_tokenizer
from memtrain.model.freeze import count_trainable
from memtrain.model.lora import add_lora, trainable_patterns


@dataclass(frozen=True)
class Target:
    """What the prediction is for: one device of a run."""

    device: str  # "cuda" or "cpu"
    dtype: str  # compute dtype of activations: "float32" | "bfloat16" | "float16"
    micro_batch_size: int
    seq_len: int  # tokens one rank holds: the sequence over the sequence-parallel size
    world_size: int
    loss: str = "standard"  # train.loss: fused | standard (memtrain.model.loss)
    tiled_mlp: object = 0  # activation_checkpointing.tiled_mlp: slices, or "auto"
    sequence_parallel: int = 1  # parallel.sequence (seq_len is already per rank)
    tp: int = 1  # tensor-parallel size (AutoTP): one rank holds the local shards (memtrain.memory.tensor_parallel)
    partition: bool = False  # checkpointed inputs partitioned across the TP group (DeepSpeed backend)
    trainable_params: int = 0  # train.trainable / train.frozen: elements that train (0: every parameter) ...
    all_params: int = 0  # ... of this many (memtrain.model.freeze); gradients and optimizer states scale by the ratio
    lora: Optional[LoraSection] = None  # model.lora: the measured layers carry the adapters (memtrain.model.lora)
    packed: bool = False  # rows pack whole samples, positions restarting (data.format chat/instruction)
    quantization: Optional[QuantizationSection] = None  # model.quantization: a 4-bit base (memtrain.model.quantize)
    grad_accum: int = 1  # train.grad_accum_steps (the JSON's gradient_accumulation_steps): micro-steps per update
    compiled: bool = False  # train.compile on: each decoder layer saves what its compiled forward keeps

    def trained(self, n: int) -> int:
        """Of `n` parameter elements (the whole model, or one TP rank's shards), those that train."""
        if not (self.trainable_params and self.all_params):
            return n
        return n if self.trainable_params == self.all_params else round(n * self.trainable_params / self.all_params)

    def to_dict(self) -> dict:
        """Plain JSON values (make plan --json): the LoRA section as the recipe writes it."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["lora"] = None if self.lora is None else self.lora.model_dump(mode="json")
        d["quantization"] = None if self.quantization is None else self.quantization.model_dump(mode="json")
        return d

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def compute_dtype(ds_config: dict, device: str) -> str:
    """The dtype DeepSpeed computes in. bf16 "auto" means on where supported: a GPU here."""
    def enabled(key):
        value = (ds_config.get(key) or {}).get("enabled", False)
        if value != AUTO:
            return bool(value)
        if device == "cuda" and torch.cuda.is_available():
            return key == "bf16" and torch.cuda.is_bf16_supported()  # as resolve_ds_config fills it
        return device == "cuda" and key == "bf16"  # planning for a GPU from a host without one

    if enabled("bf16"):
        return "bfloat16"
    if enabled("fp16"):
        return "float16"
    return "float32"


def resolve_spec(recipe, ds_config: dict, world_size: int = 1, device: Optional[str] = None,
                 model=None, largest_param: Optional[int] = None) -> tuple[RecomputeSpec, Zero3Layout]:
    """The RecomputeSpec and ZeRO-3 layout of a run of `recipe` under the JSON `ds_config` on `world_size` ranks and
    `device` (default: this machine's): one function for the run's preflight, make plan, --max-seq and the OOM advice.
    `model`: the run's model on the meta device (default: built here from the recipe); `largest_param`: its largest
    parameter's elements where the caller counted them (default: counted here)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model if model is not None else build_on_meta(recipe.model, model_and_config(recipe))
    layer_class = type(decoder_layers(model)[1][0])
    largest = largest_param if largest_param is not None else max(p.numel() for p in model.parameters())
    return resolve_with_layout(ds_config, recipe.activation_checkpointing, device, layer_class, largest,
                               max(world_size // json_tp_size(ds_config), 1))


def recompute_spec(recipe, ds_config: dict, device: Optional[str] = None, world_size: int = 1) -> RecomputeSpec:
    """The RecomputeSpec of `resolve_spec`, for a tool that plans without running."""
    return resolve_spec(recipe, ds_config, world_size, device)[0]


def make_target(recipe, ds_config: dict, world_size: int, device: Optional[str] = None,
                spec: Optional[RecomputeSpec] = None, compiled: Optional[bool] = None) -> Target:
    """The run to predict: `spec` (default: resolved for `device`) says whether checkpointed inputs are
    partitioned across the tensor-parallel group; `compiled` whether its decoder layers run compiled (default:
    train.compile true; `auto` is resolved by the run, memtrain.train.compile_choice)."""
    device = device or (spec.device if spec else ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = spec or recompute_spec(recipe, ds_config, device, world_size)
    sp = recipe.parallel.sequence
    tp = spec.tp_size
    trainable, total = _trainable(recipe)
    return Target(device, compute_dtype(ds_config, device), recipe.train.micro_batch_size,
                  max(recipe.data.seq_len // sp, 1), world_size,
                  loss=recipe.train.loss if tp <= 1 else "standard",  # AutoTP: memtrain.train.long_context
                  tiled_mlp=recipe.activation_checkpointing.tiled_mlp, sequence_parallel=sp, tp=tp,
                  partition=spec.partition_activations, trainable_params=trainable, all_params=total,
                  lora=recipe.model.lora, packed=builds_packed_mask(recipe), quantization=recipe.model.quantization,
                  grad_accum=recipe.train.grad_accum_steps,
                  compiled=recipe.train.compile is True if compiled is None else compiled)


def builds_packed_mask(recipe) -> bool:
    """Whether a step builds a (micro-batch, 1, S, S) attention mask: rows pack whole samples (data.format chat or
    instruction) and the attention is sdpa or eager; flash attention takes the restarting positions instead."""
    impl = str(recipe.model.config.get("attn_implementation") or "sdpa")
    return recipe.data.format != "text" and not impl.startswith("flash")


def _trainable(recipe) -> tuple[int, int]:
    """(elements that train, elements in all) under the recipe's train.trainable / train.frozen, counted on the
    meta model; (0, 0) when every parameter trains."""
    t = recipe.train
    if not (t.trainable or t.frozen or recipe.model.lora):
        return 0, 0

    model = build_on_meta(recipe.model, model_and_config(recipe))
    if recipe.model.lora is not None:
        add_lora(model, recipe.model.lora)
    trained = count_trainable(model, trainable_patterns(model, recipe.model.lora, t.trainable), t.frozen)
    return trained, sum(p.numel() for p in model.parameters())

def model_and_config(recipe, seq_len: Optional[int] = None):
    """The transformers config the trainer builds for this recipe (tokenizer included)."""
    tokenizer = build_tokenizer(recipe.data.tokenizer)
    return build_config(recipe.model, tokenizer.vocab_size, seq_len or recipe.data.seq_len)

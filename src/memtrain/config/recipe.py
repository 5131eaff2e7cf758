"""Recipe schema: what to train (model, data, train loop, activation recompute).

A recipe is a YAML file validated by one pydantic schema. `--set key.path=value`
overrides any key. Every mistake becomes a one-line UserError naming the file and key.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union
import copy

import yaml
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt,
                      ValidationError, field_validator, model_validator)

from memtrain.config.ac_policy import Policy, parse_policy
from memtrain.errors import UserError, not_utf8
from memtrain.units import GIB, parse_size

DEFAULT_RECIPE_NAME = "tiny"

# The embedded default: a tiny Llama that trains on the Python standard library's
# own source files in about a minute on 2 CPU cores.
DEFAULT_RECIPE: dict[str, Any] = {
    "name": DEFAULT_RECIPE_NAME,
    "model": {
        "type": "llama",
        "config": {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
        },
    },
    "data": {"seq_len": 128},
    "train": {"micro_batch_size": 8, "max_steps": 40, "lr": 3.0e-3, "warmup_steps": 4},
}


_Beta = Annotated[float, Field(ge=0, lt=1)]
_FLOAT32_MAX = 3.4028234663852886e38

# policy op's save list (memtrain.recompute.hooks.op_context_fn): a pre-norm decoder layer's last matmul
# (down_proj, fc2, c_proj) feeds only the residual add, whose backward needs neither operand: saving its output
# buys nothing, and torch's early stop ends the recompute before reaching it ('but-last' checks what it feeds).
DEFAULT_OP_SAVE = ("matmul/but-last", "attention")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # lr: .inf is a mistake


class LoraSection(_Strict):
    """LoRA adapters (peft): each target linear layer gets a trainable low-rank update; the rest is frozen."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # hashable: part of a planner key
    r: PositiveInt = 8
    """Rank of each adapter."""
    alpha: PositiveFloat = 16.0
    """Scale numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: Union[Literal["all-linear"], tuple[str, ...]] = "all-linear"
    """Module names (or suffixes, peft's matching) that get adapters, e.g. [q_proj, v_proj]; all-linear: every
    linear layer but the output head."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (peft's use_rslora): the update is scaled by alpha / sqrt(r) instead of alpha / r."""
    use_dora: bool = False
    """DoRA (peft's use_dora): each adapted weight's magnitude trains apart from its direction."""
    modules_to_save: tuple[str, ...] = ()
    """Modules that train whole beside the adapters and are saved in final/adapter (peft's modules_to_save), e.g.
    [lm_head]: a module's path or its last parts, as peft matches them. Parameters that train.trainable adds go there
    too."""


class QuantizationSection(_Strict):
    """A 4-bit base under the adapters (QLoRA, bitsandbytes): every linear layer but the output head is stored in 4
    bits and frozen (memtrain.model.quantize)."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # hashable: part of a planner key
    bits: int = 4
    """Bits per weight: 4 (bitsandbytes' NF4 or FP4). 8-bit bases are not supported."""
    type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit code: nf4 (normal float, QLoRA's) or fp4."""
    compute_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """The dtype each 4-bit weight is dequantized to for its matmul. Default: the dtype DeepSpeed computes in."""
    storage_dtype: Optional[Literal["uint8", "float32", "bfloat16", "float16"]] = None
    """The dtype the packed 4-bit codes are stored as (bitsandbytes' quant_storage; the bytes are the same). ZeRO-3
    needs the dtype DeepSpeed computes in, to partition the 4-bit weights with the rest. Default: that dtype under
    ZeRO-3, else uint8."""
    double_quant: bool = True
    """Quantize each block's scale too (bitsandbytes' compress_statistics): about 0.4 bits less per weight."""

    @field_validator("bits")
    @classmethod
    def _four_bits(cls, value):
        if value != 4:
            raise ValueError(f"only 4-bit bases are supported (QLoRA: nf4 or fp4), not {value}")
        return value


class ModelSection(_Strict):
    type: str = "llama"
    """transformers `model_type` (llama, gpt2, qwen2, mistral, ...), built with AutoConfig.for_model."""
    pretrained: Optional[str] = None
    """Optional local directory with a transformers config (and weights). Nothing is downloaded."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keys of the transformers config class, e.g. hidden_size, num_hidden_layers."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Master parameter dtype before DeepSpeed; DeepSpeed's bf16/fp16 sections decide compute precision."""
    lora: Optional[LoraSection] = None
    """LoRA adapters instead of training every weight (memtrain.model.lora); train.trainable adds parameters
    that train beside the adapters, train.frozen takes some out."""
    quantization: Optional[QuantizationSection] = None
    """QLoRA: the base's linear layers in 4 bits (memtrain.model.quantize); needs model.lora."""

    @model_validator(mode="after")
    def _adapters_on_a_quantized_base(self):
        if self.quantization is not None and self.lora is None:
            raise ValueError("model.quantization needs model.lora: a 4-bit base cannot train itself "
                             "(its weights are frozen codes); add model.lora "
                             "(QLoRA), or leave model.quantization unset to fine-tune every weight")
        return self


class ShareGPTKeys(_Strict):
    """ShareGPT messages ({from, value}): their keys, and which `from` names each chat role (LLaMA-Factory's)."""
    role_key: str = "from"
    content_key: str = "value"
    user: str = "human"
    assistant: str = "gpt"
    system: str = "system"
    function_call: str = "function_call"
    """An assistant turn that calls a tool: its value is the call (JSON of {name, arguments}, or a list of them)."""
    observation: str = "observation"
    """A tool's answer (role tool)."""


class SourceSection(_Strict):
    paths: list[str] = Field(min_length=1)
    """This source's files or glob patterns, as data.paths."""
    weight: PositiveFloat = 1.0
    """Its share of the training rows, relative to the other sources' weights."""


class DataSection(_Strict):
    paths: list[str] = Field(default_factory=list)
    """Files or glob patterns (.txt, .md, .py, .jsonl, .json, .parquet). Empty: Python's stdlib sources."""
    sources: list[SourceSection] = Field(default_factory=list)
    """A blend instead of data.paths: [{paths: [...], weight: 0.7}, ...]. Each source is its own token store
    (data.max_bytes applies to each); training rows mix them by weight, deterministically (memtrain.model.blend)."""
    text_key: str = "text"
    """Column holding text in JSONL/parquet files."""
    tokenizer: Optional[str] = None
    """'byte' (256 byte values + EOS) or a local Hugging Face tokenizer directory. Unset: model.pretrained's own
    tokenizer when its directory holds one, else 'byte' (the validated recipe, and so a run's config.json, holds
    the one chosen: `Recipe` fills it in)."""
    seq_len: PositiveInt = 128
    max_bytes: Optional[PositiveInt] = 8_000_000
    """Read at most this many characters of text (keeps the default corpus small); null: every file whole."""
    cache_dir: str = ".cache/memtrain"
    """Token stores (`store-<key>/`, keyed by files, tokenizer, text_key and max_bytes, not seq_len) and chat stores
    (`chat-<key>/`, keyed by files, tokenizer, chat template and columns, not seq_len) are cached here
    (memtrain.model.token_store, memtrain.model.chat_store)."""
    workers: Optional[PositiveInt] = None
    """Processes that tokenize a store's build. Default: the cores this process may run on."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Documents held out for evaluation, chosen by a fixed-salt hash of each document's text (not train.seed): no
    eval document is in a training row. 0: no eval split."""
    format: Literal["text", "chat", "instruction"] = "text"
    """text: documents packed end to end, every token trained on. chat: JSONL rows whose `messages_key` holds
    [{role, content}, ...]; instruction: `prompt_key` / `response_key` columns (a user and an assistant turn).
    chat and instruction render with the tokenizer's chat template, train on the assistant's tokens only, pack
    whole samples with positions restarting per sample, and report skipped rows (memtrain.model.chat_data)."""
    messages_key: str = "messages"
    """chat: the column of messages, [{role, content}, ...] (tool_calls, name and tool_call_id kept), or ShareGPT's
    [{from, value}, ...] (roles human, gpt, system, function_call, observation; keys: data.sharegpt)."""
    prompt_key: str = "prompt"
    response_key: str = "response"
    eval_paths: list[str] = Field(default_factory=list)
    """Held-out evaluation files or glob patterns, read like `paths` (same format, tokenizer and seq_len), never
    trained on. The eval loss is computed every train.eval_every steps and at the end (memtrain.train.evaluate)."""
    input_key: str = "input"
    """instruction: an optional column joined to the prompt with a newline (alpaca's input, as LLaMA-Factory does)."""
    system_key: str = "system"
    """chat / instruction: an optional column holding the system message, put first."""
    tools_key: str = "tools"
    """chat / instruction: an optional column holding the row's tools (a list, or its JSON text), passed to the chat
    template as `tools`."""
    sharegpt: ShareGPTKeys = Field(default_factory=ShareGPTKeys)
    """ShareGPT rows' keys and role names."""
    chat_template: Optional[str] = None
    """A Jinja file that replaces the tokenizer's chat template; saved into final/ with the tokenizer."""
    truncate: bool = False
    """chat / instruction: a sample longer than data.seq_len keeps its first seq_len tokens (counted in the report)
    instead of being skipped."""
    random_tokens: bool = False
    """Train on seeded random token ids over the model's vocabulary instead of files (benchmarks:
    throughput and memory do not depend on what the tokens say). No file is read."""

    @model_validator(mode="after")
    def _paths_or_sources(self):
        if self.sources and self.paths:
            raise ValueError("data.paths and data.sources are both set: give each source's paths in data.sources")
        if self.sources and self.format != "text":
            raise ValueError(f"data.sources: blends read text; data.format '{self.format}' reads data.paths")
        return self


class TrainSection(_Strict):
    micro_batch_size: PositiveInt = 8
    grad_accum_steps: PositiveInt = 1
    max_steps: PositiveInt = 40
    lr: PositiveFloat = 3.0e-3
    min_lr: float = Field(0.0, ge=0)
    """The cosine schedule's floor; at most train.lr."""
    warmup_steps: NonNegativeInt = 4
    weight_decay: float = Field(0.1, ge=0)
    adam_betas: tuple[_Beta, _Beta] = (0.9, 0.95)
    """AdamW's betas: memtrain's own AdamW (JSON without an optimizer section) and "auto" betas."""
    adam_eps: float = Field(1e-8, ge=0)
    """AdamW's eps: memtrain's own AdamW and "auto" eps."""
    grad_clip: float = Field(1.0, ge=0)
    seed: int = 1234
    log_every: Optional[PositiveInt] = Field(None, validation_alias=AliasChoices("log_every", "log_interval"))
    """Reduce the loss, agree on stop signals and log metrics every N steps (and at the last step).
    Default: the JSON's steps_per_print if it sets one, else 10. Between these boundaries a step
    never waits for the device. (`log_interval` is accepted as an old name.)"""
    metric_warmup_steps: NonNegativeInt = 3
    """Steps excluded from throughput/time medians (compilation, allocator warm-up)."""
    save_interval: NonNegativeInt = 0
    """Save a model checkpoint every N steps (0: only at the end, on a stop signal and by save_every_minutes)."""
    save_every_minutes: Optional[float] = Field(None, ge=0)
    """Also save a model checkpoint once this many minutes of training passed since the last save (rank 0's clock,
    agreed on by every rank within two steps). Default: 30 in a Slurm job (what a requeue after a lost node resumes
    from), else off; 0: off."""
    keep_last: PositiveInt = 2
    """Model checkpoints to keep; older ones are deleted."""
    save_checkpoints: bool = True
    """false: no model checkpoint at all, not at the end nor on a stop signal (benchmarks)."""
    stop_deadline_s: Optional[PositiveFloat] = None
    """Seconds a stop signal leaves before the job is killed (Slurm's --signal lead; slurm/train.sbatch sets
    it). Once a step and a save are measured, a warning if a stop (up to 2 steps, then a save) would take longer."""
    probe: bool = False
    """Count ZeRO-3's work per step (parameter fetches by layer and phase, all-gathers, DeepSpeed's
    per-step state, aten ops, CPU time: memtrain.train.zero3_probe) into summary.json's `probe`.
    For `make bench-host` and tests; the counting costs host time, so a probed run's tokens/s is not a benchmark."""
    collective_timeout_s: PositiveFloat = 1800.0
    """Seconds a collective (all-reduce, all-gather, barrier) may wait for every rank before the run stops with
    an error: a dead rank or node ends the job within it, never a hang. Long work on one rank (saving, writing
    final/) must fit; packing the corpus happens before the ranks meet, so it need not (DeepSpeed's default: 600)."""
    trainable: list[str] = Field(default_factory=list)
    """Parameter-name globs that train (e.g. [model.layers.*.mlp.*]); empty: every parameter. The rest is frozen:
    no gradient and no optimizer state (memtrain.model.freeze). `make plan` counts only what trains."""
    frozen: list[str] = Field(default_factory=list)
    """Parameter-name globs that do not train, taken out after `trainable` (e.g. [model.embed_tokens.*])."""

    @field_validator("lr")
    @classmethod
    def _representable(cls, value):
        # Adam's first update divides by 1 - beta1 (0.1 by default): beyond this it overflows float32 (a traceback
        # inside torch's optimizer, or inf weights)
        if value > _FLOAT32_MAX / 10:
            raise ValueError(f"{value:g} would overflow float32 in the optimizer's update (at most {_FLOAT32_MAX / 10:.1e})")
        return value

    @field_validator("min_lr")
    @classmethod
    def _floor_below_peak(cls, value, info):
        lr = info.data.get("lr")  # absent when lr itself failed validation: that error is the one to show
        if lr is not None and value > lr:
            raise ValueError(f"the schedule's floor must not exceed train.lr={lr:g}")
        return value
    eval_every: Optional[PositiveInt] = None
    """Evaluate the held-out data (data.eval_paths) every N steps; it is always evaluated at the last step. The
    token-weighted eval/loss and eval/perplexity go to TensorBoard, the bar, summary.json and the final line."""
    eval_batches: PositiveInt = 8
    """Global batches (an optimizer step's rows each, as Megatron's eval-iters) per eval pass; fewer when the eval
    data holds fewer rows. The same rows every time, in order: evals of one run, of a resumed one, and of one
    resumed on another world size (which keeps the global batch) compare."""
    peak_tflops: Optional[PositiveFloat] = None
    """Peak dense TFLOP/s of one device, for MFU. Auto-detected for known GPUs."""
    compile: Union[bool, Literal["auto"]] = False
    """torch.compile each decoder layer, its recompute traced inside (memtrain.recompute.compiled). auto: on for a
    GPU whose `make gpu-check` (reports/gpu/<device>.json) measured the compiled set-ups faster, off on CPU."""
    loss: Literal["fused", "standard"] = "fused"
    """fused: lm_head and cross-entropy in chunks (torch's linear_cross_entropy), never the full fp32
    logits; falls back to standard where the model transforms its logits (the plan says so).
    standard: HF's lm_head then cross_entropy on the full logits (memtrain.model.loss)."""


class ACSection(_Strict):
    policy: Policy = parse_policy("full")
    """none | full | every:K | first:N | sqrt | selective:attn | selective:mlp | op | modules, and
    compositions such as op+first:4 (see memtrain.config.ac_policy.POLICY_HELP), or auto (per-layer choice under
    memory_budget, see memtrain.memory.planner). Recompute is on only when the
    DeepSpeed JSON has an `activation_checkpointing` section; without one the default becomes none."""
    segment_len: Optional[PositiveInt] = None
    """sqrt: layers per segment (default: round(sqrt(L)) of the L layers it covers)."""
    modules: list[str] = Field(default_factory=list)
    """policy 'modules': module paths to recompute, '*' = one path part (e.g. model.layers.*.mlp)."""
    op_save: list[str] = Field(default_factory=lambda: list(DEFAULT_OP_SAVE))
    """op: ops whose outputs are saved, the rest recomputed: matmul, attention or an aten op name
    (e.g. mul.Tensor); name/N saves every N-th call only (torchtitan's matmul/2); name/but-last every
    call but each layer's last (the default for matmul: a pre-norm layer's last matmul feeds only the
    residual add, so its output is never needed)."""
    backend: Literal["auto", "torch", "deepspeed"] = "auto"
    """auto: DeepSpeed's checkpoint when the JSON asks for partitioning or CPU checkpointing, else torch's."""
    deepspeed_reentrant: bool = True
    """backend deepspeed: DeepSpeed's reentrant `checkpoint` (true) or its `non_reentrant_checkpoint` (false);
    both partition and offload the checkpointed inputs as the JSON says."""
    offload_skip_last: NonNegativeInt = 1
    """With the JSON's cpu_checkpointing on: the last N offload units keep their checkpointed input on
    the device (the backward needs them first); all earlier ones go to host memory. A unit is what
    one checkpoint call keeps an input for: a recomputed layer (or its sublayer), a sqrt segment
    (its head layer's input), a module matched by policy 'modules'."""
    cpu_checkpointing_impl: Literal["memtrain", "deepspeed"] = "memtrain"
    """Who offloads when the JSON's cpu_checkpointing is on: memtrain (memtrain.recompute.offload, either
    backend) or DeepSpeed's own CPU_CHECKPOINT (for comparison; needs the deepspeed backend)."""
    tiled_mlp: Union[Literal["auto"], NonNegativeInt] = 0
    """Run each decoder layer's MLP in N slices of the micro-batch's tokens (DeepSpeed's TiledMLP; the backward
    recomputes a slice): auto = ceil(sequence tokens per rank / hidden); 0 or 1: untiled (memtrain.model.tiled_mlp)."""
    memory_budget: Optional[PositiveFloat] = None
    """policy 'auto': GiB per device (or a size: 40GiB, 80GB; memtrain.units) the predicted peak must fit
    (memtrain.memory.planner picks, per layer,
    keep/op/attn/mlp/full/full+offload with the least predicted step time). On CPU the budget
    applies to the predicted model states + activations, not to the process RSS."""

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, value):
        """A size string goes through the one size parser, as BUDGET= does; numbers are GiB."""
        if isinstance(value, str):
            return parse_size(value, "activation_checkpointing.memory_budget") / GIB
        return value


class ParallelSection(_Strict):
    sequence: PositiveInt = 1
    """Ulysses sequence parallelism: N consecutive ranks split each sequence (DeepSpeed's
    UlyssesSPAttentionHF; memtrain.train.sequence_parallel). The JSON's sequence_parallel_size is
    filled from it. Needs ZeRO >= 1 and attn_implementation sdpa or flash attention."""


class Recipe(_Strict):
    name: str = DEFAULT_RECIPE_NAME
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    activation_checkpointing: ACSection = Field(default_factory=ACSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)

    @model_validator(mode="after")
    def _default_tokenizer(self):
        """data.tokenizer left unset: the pretrained directory's own tokenizer, else memtrain's byte tokenizer."""
        if self.data.tokenizer is None:
            self.data.tokenizer = pretrained_tokenizer(self.model.pretrained) or "byte"
        return self


# Files of which AutoTokenizer builds a tokenizer (fast, sentencepiece, BPE vocabularies, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")


def pretrained_tokenizer(pretrained: Optional[str]) -> Optional[str]:
    """`pretrained` when that directory ships a tokenizer (what data.tokenizer defaults to), else None."""
    if pretrained and any((Path(pretrained) / name).is_file() for name in TOKENIZER_FILES):
        return pretrained
    return None


# --------------------------------------------------------------------------- loading

def did_you_mean(model: type[BaseModel], loc: tuple) -> str:
    """Suggest the closest valid key for an unknown key at `loc`."""
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return ""
        cls = field.annotation
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(cls.model_fields), n=1)
    allowed = ", ".join(cls.model_fields)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}allowed: {allowed}"


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel]) -> str:
    """First pydantic error as '<source>: <key.path>: <what is wrong>'."""
    e = err.errors()[0]
    loc = tuple(e["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'; {did_you_mean(model, loc)}"
    value = e.get("input")
    shown = f" (got {value!r})" if not isinstance(value, (dict, list)) and repr(value) not in e["msg"] else ""
    # a Union key (e.g. train.compile: bool | 'auto'): pydantic reports one error per member, each with the member's
    # tag appended to the key; name the key and every alternative instead of the first member's tag and message
    members = [m for m in err.errors() if tuple(m["loc"])[:-1] == loc[:-1] and m.get("input") is value]
    if len(members) > 1 and isinstance(loc[-1], str):
        key = ".".join(str(p) for p in loc[:-1])
        wanted = " or ".join(m["msg"].removeprefix("Input should be ").split(", ")[0] for m in members)
        return f"{source}: {key}: expected {wanted}{shown}"
    return f"{source}: {key}: {e['msg']}{shown}"


def parse_scalar(text: str) -> Any:
    """--set values are YAML scalars: 4 -> int, 1e-3 -> float, true -> bool, every:2 -> str. A flow list that is
    not YAML (a glob such as *.mlp.* starts like a YAML alias) is its comma-separated items, each a scalar."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        inner = text.strip()
        if inner.startswith("[") and inner.endswith("]"):
            return [parse_scalar(item.strip()) for item in inner[1:-1].split(",") if item.strip()]
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `key.path=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key.path=value")
        path, _, raw = item.partition("=")
        keys = path.strip().split(".")
        if not all(keys):
            raise UserError(f"--set {item!r}: empty key in path '{path}'")
        node = data
        for k in keys[:-1]:
            if node.get(k) is None:  # absent, or an optional section left unset (model.lora: null)
                node[k] = {}
            child = node[k]
            if not isinstance(child, dict):
                raise UserError(f"--set {path}: '{k}' is not a section")
            node = child
        node[keys[-1]] = parse_scalar(raw)
    return data


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: recipe file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: {not_utf8(e)}; "
                        "save the recipe as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{p}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def load_recipe(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                saved: Optional[tuple[str, dict]] = None) -> Recipe:
    """Load a recipe file (or `saved`: (its source, a recipe as a run saved it), or else the embedded default),
    apply overrides and validate."""
    if saved is not None and not path:
        source, data = saved[0], copy.deepcopy(saved[1])
    elif path:
        data = load_yaml(path)
        data.setdefault("name", Path(path).stem)
        source = str(path)
    else:
        data = copy.deepcopy(DEFAULT_RECIPE)
        source = "recipe 'tiny' (embedded default)"
    if overrides:
        apply_overrides(data, overrides)
        source += " with --set"
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, source, Recipe)) from None

"""DeepSpeed JSON: load it, and fill its "auto" values from the recipe and the model (one table).

As with transformers' DeepSpeed integration (`HfTrainerDeepSpeedConfig`), values such as batch
sizes, learning rate, Adam's betas/eps, the schedule's length and the ZeRO bucket sizes may be
written "auto"; they are filled from the recipe and the model so the files cannot disagree.
`AUTO_KEYS` is the one list of what memtrain fills and from where: validation
(memtrain.train.preflight), `memtrain explain-config` and the trainer all read it.
What DeepSpeed itself defines about its JSON (its keys, the activation-checkpointing defaults)
is taken from DeepSpeed's own modules here, not copied.
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memtrain.errors import UserError, not_utf8
from memtrain.config.recipe import Recipe
from memtrain.config.saved_run import CSV_DIR, TENSORBOARD_DIR

AUTO = "auto"


def load_ds_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: DeepSpeed config not found")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: {not_utf8(e)}; "
                        "a DeepSpeed config is JSON, which is UTF-8") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{p}: a DeepSpeed config must be a JSON object")
    return cfg


def bf16_supported() -> bool:
    import torch  # noqa: PLC0415 here, not at the top: the tools' --help imports this module and must not wait for torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def has(cfg: dict, dotted: str) -> bool:
    missing = object()
    return get(cfg, dotted, missing) is not missing


def zero_stage(cfg: dict) -> int:
    stage = get(cfg, "zero_optimization.stage", 0)
    return int(stage) if isinstance(stage, int) else 0


def offload_device(cfg: dict, what: str) -> str:
    """'none', 'cpu' or 'nvme' for zero_optimization.offload_<what> (optimizer or param); "auto" is filled "none"."""
    device = str(get(cfg, f"zero_optimization.offload_{what}.device") or "none")
    return "none" if device == AUTO else device


def engine_dtype(cfg: dict) -> str:
    """The dtype DeepSpeed computes in, from a resolved JSON (its bf16/fp16 "auto"s filled)."""
    if get(cfg, "bf16.enabled") is True:
        return "bfloat16"
    return "float16" if get(cfg, "fp16.enabled") is True else "float32"


# --------------------------------------------------------------------------- what DeepSpeed defines

@functools.lru_cache(maxsize=None)
def deepspeed_top_level_keys() -> frozenset:
    """The top-level keys DeepSpeed's DeepSpeedConfig reads, recorded by letting it parse an
    (almost) empty config through a dict that notes every key asked for (~20 ms). DeepSpeed has
    no list of its own; recording it keeps this in step with the installed version."""
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: PLC0415 deepspeed: heavy, kept off --help

    seen: set = set()

    class _Keys:
        def __init__(self, d):
            self.d = d

        def __contains__(self, k):
            seen.add(k)
            return dict.__contains__(self.d, k)

        def __iter__(self):
            return iter(dict.keys(self.d))

        def __len__(self):
            return len(self.d)

    class _Recording(dict):
        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            return _Keys(self)

    DeepSpeedConfig(_Recording({"train_micro_batch_size_per_gpu": 1}))
    # By hand: read by the engine (sequence parallelism), not by DeepSpeedConfig.
    return frozenset(k for k in seen if isinstance(k, str)) | {"sequence_parallel_size"}


def tp_size(ds_config: dict) -> int:
    """`tensor_parallel.autotp_size` (DeepSpeed's AutoTP); 0 and 1 both mean no tensor parallelism."""
    section = ds_config.get("tensor_parallel")
    size = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def ac_defaults() -> dict:
    """DeepSpeed's activation_checkpointing keys and their defaults (its own ACT_CHKPT_DEFAULT)."""
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT  # noqa: PLC0415 deepspeed: heavy, kept off --help

    return dict(ACT_CHKPT_DEFAULT)


# --------------------------------------------------------------------------- the "auto" table

@dataclass(frozen=True)
class FillContext:
    """What an "auto" value may be filled from."""

    recipe: Recipe
    world_size: int
    hidden_size: Optional[int] = None  # the model's; None where the model is not known
    num_checkpoints: int = 0  # checkpoint calls the AC plan makes per forward
    raw: Optional[dict] = None  # the JSON as written


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any, minimum: float = 0.0) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= minimum


def _positive(v: Any) -> bool:
    return _number(v) and v > 0


def _betas(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(b) and b < 1 for b in v)


def _fp16_requested(c: FillContext) -> bool:
    return get(c.raw or {}, "fp16.enabled") is True


@dataclass(frozen=True)
class AutoKey:
    key: str  # dotted JSON key
    source: str  # where the value comes from (recipe key or the model), for messages
    fill: Callable[[FillContext], Any]
    check: Callable[[Any], bool]  # for a value written explicitly (DeepSpeed would take it late or never)
    allowed: str
    must_match: bool = False  # an explicit value that differs from the source is an error (else a warning)
    if_missing: bool = False  # also filled when the key is absent
    needs_model: bool = False
    from_recipe: bool = True  # filled from a recipe key: an explicit JSON value that differs gets a warning


# The keys transformers' HfTrainerDeepSpeedConfig fills (trainer_config_process/_finalize), with
# the recipe in the role of TrainingArguments, plus memtrain's own (torch_adam, cos_min_ratio,
# number_checkpoints). Explicit values win, except batch sizes, which must agree.
AUTO_KEYS: tuple[AutoKey, ...] = (
    AutoKey("train_micro_batch_size_per_gpu", "train.micro_batch_size", lambda c: c.recipe.train.micro_batch_size,
            _positive_int, "a positive integer", must_match=True, if_missing=True),
    AutoKey("gradient_accumulation_steps", "train.grad_accum_steps", lambda c: c.recipe.train.grad_accum_steps,
            _positive_int, "a positive integer", must_match=True, if_missing=True),
    # DeepSpeed counts a sequence-parallel group as one data-parallel rank (memtrain.train.sequence_parallel)
    AutoKey("sequence_parallel_size", "parallel.sequence", lambda c: c.recipe.parallel.sequence,
            _positive_int, "a positive integer", must_match=True, if_missing=True),
    AutoKey("train_batch_size", "micro batch x grad accum x world size / parallel.sequence",
            lambda c: c.recipe.train.micro_batch_size * c.recipe.train.grad_accum_steps
            * max(c.world_size // c.recipe.parallel.sequence, 1),
            _positive_int, "a positive integer", must_match=True, if_missing=True),
    AutoKey("gradient_clipping", "train.grad_clip", lambda c: c.recipe.train.grad_clip, _number, "a number >= 0"),
    AutoKey("optimizer.params.lr", "train.lr", lambda c: c.recipe.train.lr,
            _positive, "a positive number"),
    AutoKey("optimizer.params.betas", "train.adam_betas", lambda c: list(c.recipe.train.adam_betas), _betas,
            "two numbers in [0, 1)"),
    AutoKey("optimizer.params.eps", "train.adam_eps", lambda c: c.recipe.train.adam_eps, _number, "a number >= 0"),
    AutoKey("optimizer.params.weight_decay", "train.weight_decay", lambda c: c.recipe.train.weight_decay,
            _number, "a number >= 0"),
    # memtrain's: torch's AdamW (the same math as DeepSpeed's FusedAdam) unless the optimizer is
    # offloaded, so that no launch JIT-builds a DeepSpeed op; offloaded, DeepSpeed's CPU Adam.
    AutoKey("optimizer.params.torch_adam", "no optimizer offload",
            lambda c: offload_device(c.raw or {}, "optimizer") == "none", lambda v: isinstance(v, bool),
            "true or false", from_recipe=False),
    # (train.warmup_steps 0: train.lr, so the warm-up DeepSpeed's classes always take is flat: the full learning rate
    # from step 1, not 0 for two steps)
    AutoKey("scheduler.params.warmup_min_lr", "0 (as transformers; train.lr with train.warmup_steps 0)",
            lambda c: c.recipe.train.lr if c.recipe.train.warmup_steps == 0 else 0.0, _number, "a number >= 0",
            from_recipe=False),
    AutoKey("scheduler.params.warmup_max_lr", "train.lr", lambda c: c.recipe.train.lr,
            _positive, "a positive number"),
    AutoKey("scheduler.params.total_num_steps", "train.max_steps", lambda c: c.recipe.train.max_steps,
            _positive_int, "a positive integer"),
    # DeepSpeed >= 0.19.6 rejects 0 warm-up steps; transformers fills max(1, warmup) for the same reason.
    AutoKey("scheduler.params.warmup_num_steps", "train.warmup_steps",
            lambda c: max(1, c.recipe.train.warmup_steps), _positive_int, "a positive integer"),
    AutoKey("scheduler.params.cos_min_ratio", "train.min_lr / train.lr",
            lambda c: c.recipe.train.min_lr / c.recipe.train.lr, _number, "a number >= 0"),
    AutoKey("bf16.enabled", "the device (bf16 where supported)",
            lambda c: bf16_supported() and not _fp16_requested(c), lambda v: isinstance(v, bool), "true or false",
            from_recipe=False),
    AutoKey("fp16.enabled", "off (memtrain turns bf16 on where supported)", lambda c: False,
            lambda v: isinstance(v, bool), "true or false", from_recipe=False),
    # accelerate's DeepSpeed plugin fills these from its own config (accelerate config), whose defaults are no
    # offload; memtrain always gathers the ZeRO-3 weights in 16 bits for final/, so it knows this one's value
    AutoKey("zero_optimization.stage3_gather_16bit_weights_on_model_save", "memtrain's final/ (weights gathered)",
            lambda c: True, lambda v: isinstance(v, bool), "true or false", from_recipe=False),
    AutoKey("zero_optimization.offload_optimizer.device", "none (accelerate's default)", lambda c: "none",
            lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme", from_recipe=False),
    AutoKey("zero_optimization.offload_param.device", "none (accelerate's default)", lambda c: "none",
            lambda v: v in ("none", "cpu", "nvme"), "none, cpu or nvme", from_recipe=False),
    AutoKey("zero_optimization.reduce_bucket_size", "hidden_size^2", lambda c: c.hidden_size ** 2,
            _positive, "a positive number", needs_model=True),
    AutoKey("zero_optimization.stage3_prefetch_bucket_size", "0.9 x hidden_size^2",
            lambda c: int(0.9 * c.hidden_size ** 2), _positive, "a positive number", needs_model=True),
    AutoKey("zero_optimization.stage3_param_persistence_threshold", "10 x hidden_size",
            lambda c: 10 * c.hidden_size, _number, "a number >= 0 (0: no parameter persists)", needs_model=True),
    AutoKey("activation_checkpointing.number_checkpoints", "the AC plan's checkpoint calls per forward",
            lambda c: max(c.num_checkpoints, 1), lambda v: v is None or _positive_int(v),
            "a positive integer or null", from_recipe=False),
)
AUTO_BY_KEY = {a.key: a for a in AUTO_KEYS}


def auto_paths(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key whose value is "auto"."""
    out = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if v == AUTO:
                out.append(path)
            else:
                out += auto_paths(v, path)
    return out


# Keys whose "auto" memtrain rewrites regardless (its run directory owns the monitors' output).
MONITOR_KEYS = {f"{m}.{k}" for m in ("tensorboard", "csv_monitor") for k in ("output_path", "job_name")}


def unfillable_auto(cfg: dict) -> list[str]:
    return [p for p in auto_paths(cfg) if p not in AUTO_BY_KEY and p not in MONITOR_KEYS]


def _set(cfg: dict, dotted: str, value: Any, if_missing: bool) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for k in parents:
        if not isinstance(node.get(k), dict):
            if not if_missing:
                return
            node[k] = {}
        node = node[k]
    if node.get(leaf, AUTO if if_missing else None) == AUTO:
        node[leaf] = value


def resolve_ds_config(raw: dict, recipe: Recipe, world_size: int, run_dir: Path, num_ac_layers: int,
                      hidden_size: Optional[int] = None, default_tensorboard: bool = False) -> dict:
    """A copy of the DeepSpeed JSON with every "auto" of `AUTO_KEYS` filled. `num_ac_layers`:
    checkpoint calls per forward; `hidden_size`: the model's (None leaves the model's "auto"s)."""
    cfg = copy.deepcopy(raw)
    ctx = FillContext(recipe, world_size, hidden_size, num_ac_layers, raw)
    for a in AUTO_KEYS:
        if a.needs_model and hidden_size is None:
            continue
        _set(cfg, a.key, a.fill(ctx), a.if_missing)
    _adam_implementation(cfg, raw)
    if "optimizer" not in cfg and offload_device(cfg, "optimizer") == "none" and zero_stage(cfg):
        # memtrain builds torch's AdamW (memtrain.train.optimizer); ZeRO takes a client optimizer
        # that is not DeepSpeed's only with this flag (transformers sets it the same way)
        cfg.setdefault("zero_allow_untested_optimizer", True)
    ac = cfg.get("activation_checkpointing")
    if isinstance(ac, dict) and "number_checkpoints" not in ac:  # left out: from the plan, as "auto"
        ac["number_checkpoints"] = max(num_ac_layers, 1)
    cfg.setdefault("steps_per_print", 10**9)  # memtrain logs itself; keep DeepSpeed's stdout quiet
    if default_tensorboard:  # a run's metrics go to run_dir/tb (the summary points there) unless the
        cfg.setdefault("tensorboard", {"enabled": True})  # JSON turns it off; HF-style JSONs have no section
    for monitor, sub in (("tensorboard", TENSORBOARD_DIR), ("csv_monitor", CSV_DIR)):
        if isinstance(cfg.get(monitor), dict):
            cfg[monitor]["output_path"] = str(run_dir)
            cfg[monitor]["job_name"] = sub
    return cfg


def _adam_implementation(cfg: dict, raw: dict) -> None:
    """Adam/AdamW sections: torch's AdamW (same math as DeepSpeed's FusedAdam, fused on a GPU) when
    `torch_adam` is "auto" or absent and nothing is offloaded, so that no launch JIT-builds
    DeepSpeed's FusedAdam op (minutes on a CPU). `torch_adam: false` keeps DeepSpeed's op."""
    params = get(cfg, "optimizer.params")
    name = get(cfg, "optimizer.type")
    if not (isinstance(name, str) and name.lower() in ("adam", "adamw")):
        return
    if not isinstance(params, dict):
        cfg["optimizer"]["params"] = params = {}
    if "torch_adam" not in params and offload_device(cfg, "optimizer") == "none":
        params["torch_adam"] = True
    written = get(raw, "optimizer.params.torch_adam")
    import torch  # noqa: PLC0415 torch: heavy, kept off --help

    if params.get("torch_adam") is True and written in (AUTO, None) and "foreach" not in params \
            and torch.cuda.is_available():
        params.setdefault("fused", True)


def recipe_disagreements(cfg: dict, recipe: Recipe, world_size: int) -> list[tuple[AutoKey, Any, Any]]:
    """(key, JSON value, recipe value) for each explicit JSON value that differs from what "auto"
    would be (model-derived keys excepted: any explicit bucket size is a fine choice)."""
    ctx = FillContext(recipe, world_size, None, 0, cfg)
    out = []
    for a in AUTO_KEYS:
        if a.needs_model or not a.from_recipe:
            continue
        present, value = has(cfg, a.key), get(cfg, a.key)
        if not present or value == AUTO:
            continue
        wanted = a.fill(ctx)
        if isinstance(wanted, list):
            same = isinstance(value, (list, tuple)) and list(value) == wanted
        else:
            same = value == wanted
        if a.key == "scheduler.params.warmup_num_steps":  # the recipe's value; "auto" fills at least 1
            wanted = recipe.train.warmup_steps
            same = value == wanted or (wanted == 0 and value == 1)
        if not same:
            out.append((a, value, wanted))
    return out


def model_hidden_size(config) -> Optional[int]:
    """The hidden size transformers' DeepSpeed integration sizes buckets by: hidden_size, else the
    largest of hidden_sizes, else the text config's."""
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None

"""Which parameters train: the recipe's `train.trainable` / `train.frozen` name globs, checked on the meta model.

`trainable` (empty: every parameter; with LoRA adapters, memtrain.model.lora: the adapters) selects what
trains, adapters always included; `frozen` then takes parameters out again.
Patterns are shell globs (`fnmatch`, `*` crosses dots) over the names `model.named_parameters()` gives,
tied names included (`lm_head.weight` names the embedding when the two are tied): e.g.
`model.embed_tokens.*`, `model.layers.[0-3].*`, `*.mlp.*`. A frozen parameter gets `requires_grad=False`
before DeepSpeed sees the model, and only trainable ones go to the optimizer: no gradient, no gradient
partition, no Adam state for it, under every ZeRO stage and offload (DeepSpeed's optimizers keep
states for the parameters they are given).

A frozen embedding makes the first decoder layer's input a tensor that does not require grad. A
reentrant checkpoint (DeepSpeed's `checkpoint`) of that layer then returns outputs that do not require
grad either, and the layer's own trainable weights get no gradient at all; transformers'
`enable_input_require_grads` (a hook on the input embeddings) is the fix memtrain applies then.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable

from torch import nn

from memtrain.errors import UserError
from memtrain.model.lora import is_adapter, saved_modules, trainable_patterns


def _names(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter (by identity) with every name it has, tied names included."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def trainable_names(model: nn.Module, trainable: Iterable[str] = (), frozen: Iterable[str] = ()) -> set[str]:
    """The first name of every parameter that trains; UserError (one line) for a pattern that matches no
    parameter, or when nothing is left to train."""
    trainable, frozen = list(trainable), list(frozen)
    names = _names(model)
    every = [n for group in names.values() for n in group]
    for key, patterns in (("train.trainable", trainable), ("train.frozen", frozen)):
        for pattern in patterns:
            if not any(fnmatchcase(n, pattern) for n in every):
                example = ", ".join(every[:3])
                raise UserError(f"{key}: '{pattern}' matches no parameter of {type(model).__name__} "
                                f"(names look like {example}, ...)")
    adapters = any(is_adapter(n) for n in every)
    chosen = set()
    for group in names.values():
        adapter = any(is_adapter(n) for n in group)
        selected = adapter or (any(fnmatchcase(n, p) for n in group for p in trainable) if trainable else not adapters)
        if selected and not any(fnmatchcase(n, p) for n in group for p in frozen):
            chosen.add(group[0])
    if not chosen:
        raise UserError("train.frozen: every parameter is frozen; nothing would train")
    return chosen


def count_trainable(model: nn.Module, trainable: Iterable[str] = (), frozen: Iterable[str] = ()) -> int:
    """Elements of the parameters that train (each tied parameter once), on any device, meta included."""
    keep = trainable_names(model, trainable, frozen)
    return sum(p.numel() for n, p in model.named_parameters() if n in keep)


def freeze(model: nn.Module, trainable: Iterable[str] = (), frozen: Iterable[str] = ()) -> tuple[int, int]:
    """Sets requires_grad=False on every parameter that does not train; (trainable, total) parameter counts,
    by element (under ZeRO-3 the full sizes: `ds_numel`). With a frozen input embedding, makes the embedding
    output require grad so that a reentrant checkpoint of the first layer still yields gradients."""
    keep = trainable_names(model, trainable, frozen)
    counts = [0, 0]
    for name, p in model.named_parameters():
        size = getattr(p, "ds_numel", p.numel())
        counts[1] += size
        counts[0] += size if name in keep else 0
        p.requires_grad_(name in keep)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and not any(p.requires_grad for p in embeddings.parameters()):
        model.enable_input_require_grads()
    return counts[0], counts[1]


def saved_with_adapters(model: nn.Module, lora, trainable: Iterable[str] = (), frozen: Iterable[str] = ()) -> tuple[str, ...]:
    """The modules final/adapter keeps whole beside the adapters (peft's modules_to_save): those holding a parameter
    that trains and is no adapter, on the adapted `model` (meta, partitioned or whole). UserError (one line) for a
    parameter peft cannot keep there."""
    trained = trainable_names(model, trainable_patterns(model, lora, trainable), frozen)
    # a tied parameter under each of its names: the adapter keeps every module that holds it (lm_head and the embedding)
    return saved_modules(model, {n for group in _names(model).values() if group[0] in trained for n in group})

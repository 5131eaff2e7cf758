"""The activation-checkpointing policy string parsed into a frozen `Policy`: the one parser of 'op+first:4'.

The recipe's `activation_checkpointing.policy` is validated into a `Policy` by this module's `_parse`
(pydantic calls it for the recipe file, `--set` and assignment); `parse_policy` wraps it for a tool's policy
string (`plan_for`).
Everyone else reads the parsed fields: `base`, `selector`, `count`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from pydantic_core import PydanticCustomError, core_schema

from memtrain.errors import UserError

POLICY_HELP = ("none | full | every:K | first:N | sqrt | selective:attn | selective:mlp | op | modules | "
               "auto (per layer, under activation_checkpointing.memory_budget); "
               "full, sqrt, op and selective:* also take +first:N, and all but sqrt +every:K (e.g. op+first:4)")
# Bases that recompute the layers a selector picks (bare every:K / first:N are full's)
LAYER_BASES = ("full", "sqrt", "op", "selective:attn", "selective:mlp")
_WHOLE = ("none", "modules", "auto")  # bases that take no layer selector
CUSTOM = "custom"  # the base of a plan given layer by layer (recompute.policy.custom_plan), never parsed


class _NotAPolicy(ValueError):
    """What is wrong with a policy string, as the line after its key: "'<text>': <why>; allowed: ..."."""

    def __init__(self, text: str, why: str):
        super().__init__(f"'{text}': {why}; allowed: {POLICY_HELP}")


@dataclass(frozen=True, eq=False)
class Policy:
    """A parsed policy: `base` (none, full, sqrt, op, selective:attn, selective:mlp, modules, auto; custom for a
    given plan), and the layers it covers: `selector` first or every with its `count`, or None for every layer.
    `text` is what the recipe says, and what every message and record shows; a Policy equals (and hashes as) its
    text, so `policy == "auto"` reads as it did when the recipe held the string."""

    text: str
    base: str
    selector: Optional[str] = None
    count: Optional[int] = None

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Policy, str)):
            return self.text == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.text)

    def selected(self, num_layers: int) -> tuple[bool, ...]:
        """Which of `num_layers` layers the policy recomputes (all of them for a base without a selector)."""
        if self.base in ("none", "modules"):
            return (False,) * num_layers
        if self.selector == "first":
            return tuple(i < self.count for i in range(num_layers))
        if self.selector == "every":
            return tuple(i % self.count == 0 for i in range(num_layers))
        return (True,) * num_layers

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        """A recipe key: a string parsed by `_parse` (its message kept whole), saved back as its text."""
        return core_schema.no_info_plain_validator_function(
            _validate, serialization=core_schema.plain_serializer_function_ser_schema(str))


def _validate(value: Any) -> Policy:
    if isinstance(value, Policy):
        return value
    if not isinstance(value, str):
        raise PydanticCustomError("ac_policy", "expected a policy string; allowed: {help}", {"help": POLICY_HELP})
    try:
        return _parse(value)
    except _NotAPolicy as e:
        raise PydanticCustomError("ac_policy", "{detail}", {"detail": str(e)}) from None


def _count(text: str, policy: str) -> int:
    if not re.fullmatch(r"[0-9]+", text) or int(text) <= 0:
        raise _NotAPolicy(policy, f"expected a positive integer after ':', got '{text}'")
    return int(text)


def _selector(selector: str, policy: str) -> tuple[str, int]:
    name, sep, arg = selector.partition(":")
    if name in ("first", "every") and sep:
        return name, _count(arg, policy)
    raise _NotAPolicy(policy, f"unknown layer selector '{selector}'")


def parse_policy(text: str) -> Policy:
    """A policy string outside a recipe (a tool's argument): `_parse`'s value, or its one-line UserError."""
    try:
        return _parse(text)
    except _NotAPolicy as e:
        raise UserError(f"activation_checkpointing.policy: {e}") from None


def _parse(text: str) -> Policy:
    """The one parser of a policy string (POLICY_HELP): its base and layer selector."""
    base, plus, selector = text.strip().partition("+")
    if base in ("none", "modules") and plus:
        raise _NotAPolicy(text, f"'{base}' takes no layer selector")
    if base in _WHOLE and not plus:
        return Policy(text, base)
    if base.startswith(("every:", "first:")) and not plus:
        return Policy(text, "full", *_selector(base, text))
    if base not in LAYER_BASES:
        raise _NotAPolicy(text, "unknown policy")
    if base == "sqrt" and plus and not selector.startswith("first:"):
        raise _NotAPolicy(text, "sqrt segments are runs of consecutive layers; it composes with +first:N only")
    return Policy(text, base, *_selector(selector, text)) if plus else Policy(text, base)


NO_POLICY = Policy("none", "none")


def custom_policy(label: str) -> Policy:
    """A plan given layer by layer, shown as `label` (tests, the activation profile)."""
    return Policy(label, CUSTOM)

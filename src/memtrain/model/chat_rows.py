"""A dataset row as the messages and tools a chat template renders: chat rows (tool calls kept), ShareGPT rows,
instruction (alpaca) columns.

- chat: `data.messages_key` holds [{role, content}, ...]; `tool_calls`, `name` and `tool_call_id` are kept (an
  assistant turn that only calls a tool may have no content). ShareGPT's [{from, value}, ...] is read too
  (`data.sharegpt` names its keys and roles): human → user, gpt → assistant, system → system, function_call → an
  assistant turn whose `tool_calls` hold the value's JSON ({name, arguments}, or a list of them), observation →
  tool.
- instruction: `data.prompt_key` and `data.response_key` as a user and an assistant turn; a non-empty
  `data.input_key` (alpaca's input) is joined to the prompt with a newline, as LLaMA-Factory's alpaca reader does.
- Either: a non-empty `data.system_key` column is the first, system message (unless the messages start with one);
  a `data.tools_key` column (a list, or its JSON text) is passed to the template as `tools`.

`datasets` reads JSON lines into Arrow columns, which give every message each key any message has (absent ones as
None): None values are dropped, so a message keeps only what its row wrote.
"""
from __future__ import annotations

import json
from typing import Optional

from memtrain.config.recipe import DataSection

MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id")


def columns(cfg: DataSection) -> tuple[list[str], list[str]]:
    """(columns every file must have, columns read where a file has them) for `cfg.format`."""
    required = [cfg.messages_key] if cfg.format == "chat" else [cfg.prompt_key, cfg.response_key]
    optional = [cfg.system_key, cfg.tools_key] + ([cfg.input_key] if cfg.format == "instruction" else [])
    return required, [k for k in dict.fromkeys(optional) if k not in required]


def row_messages(row: dict, cfg: DataSection) -> tuple[Optional[list[dict]], Optional[list], Optional[str]]:
    """(messages, tools or None, None), or (None, None, why the row is skipped)."""
    tools, why = _tools(row.get(cfg.tools_key))
    if why is None:
        messages, why = _instruction(row, cfg) if cfg.format == "instruction" else _chat(row.get(cfg.messages_key), cfg)
    if why is not None:
        return None, None, why
    system = row.get(cfg.system_key)
    if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    if not any(m["role"] == "assistant" for m in messages):
        return None, None, "no assistant turn"
    return messages, tools, None


def _clean(value):
    """`value` without the None entries Arrow filled in (recursively)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _tools(value) -> tuple[Optional[list], Optional[str]]:
    if value is None or value == "" or value == []:
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, "malformed tools (not JSON)"
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None, "malformed tools (not a list of objects)"
    return _clean(value), None


def _instruction(row: dict, cfg: DataSection):
    prompt, response, extra = row.get(cfg.prompt_key), row.get(cfg.response_key), row.get(cfg.input_key)
    if not isinstance(prompt, str) or not isinstance(response, str) or not response:
        return None, "no prompt or response"
    if isinstance(extra, str) and extra.strip():
        prompt = f"{prompt}\n{extra}" if prompt else extra
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], None


def _chat(messages, cfg: DataSection):
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return None, "malformed messages"
    keys = cfg.sharegpt
    if all(m.get("role") is None and m.get(keys.role_key) is not None for m in messages):
        return _sharegpt(messages, cfg)
    out = [_message(m) for m in messages]
    return (None, "malformed messages") if any(m is None for m in out) else (out, None)


def _message(m: dict) -> Optional[dict]:
    """A chat message with the keys templates read, or None when malformed."""
    m = {k: _clean(m[k]) for k in MESSAGE_KEYS if m.get(k) is not None}
    calls = m.get("tool_calls")
    if not isinstance(m.get("role"), str) or (calls is not None and not isinstance(calls, list)):
        return None
    if "content" not in m and calls:
        m["content"] = ""  # a turn that only calls a tool: templates concatenate its content
    if not isinstance(m.get("content"), str) or any(not isinstance(m.get(k, ""), str) for k in ("name", "tool_call_id")):
        return None
    return m


def _sharegpt(messages: list[dict], cfg: DataSection):
    keys = cfg.sharegpt
    roles = {keys.user: "user", keys.assistant: "assistant", keys.system: "system", keys.observation: "tool"}
    out = []
    for m in messages:
        role, value = m.get(keys.role_key), m.get(keys.content_key)
        if not isinstance(value, str):
            return None, "malformed messages"
        if role == keys.function_call:
            calls = _calls(value)
            if calls is None:
                return None, "malformed function_call (not JSON of {name, arguments})"
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif role in roles:
            out.append({"role": roles[role], "content": value})
        else:
            return None, f"unknown ShareGPT role '{role}'"
    return out, None


def _calls(value: str) -> Optional[list[dict]]:
    """A ShareGPT function_call's value as chat tool calls ({type: function, function: {name, arguments}})."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError:
        return None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]

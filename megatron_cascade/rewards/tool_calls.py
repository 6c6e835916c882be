"""Tool calls in a model's output, in the chat templates' format (Qwen3, Nemotron, Hermes)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from megatron_cascade.rewards.strict_json import loads_strict

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its JSON-object arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class BadToolCall:
    """A ``<tool_call>`` block that is not a call; ``reason`` says why (fed back to the model)."""

    reason: str


def parse_tool_calls(text: str) -> list[Union[ToolCall, BadToolCall]]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last block is a ``BadToolCall``).

    The block is JSON ``{"name": str, "arguments": object}``; ``arguments`` may also be a JSON string
    of an object (OpenAI style). One pass over the text (no backtracking regex).
    """
    calls: list[Union[ToolCall, BadToolCall]] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(BadToolCall("<tool_call> is never closed by </tool_call>"))
            break
        calls.append(_parse_one(text[start + len(OPEN):end]))
        pos = end + len(CLOSE)
    return calls


def _parse_one(body: str) -> Union[ToolCall, BadToolCall]:
    try:
        obj: Any = loads_strict(body.strip())
    except ValueError as exc:
        return BadToolCall(f"the tool call is not JSON ({exc})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return BadToolCall('a tool call must be {"name": <string>, "arguments": <object>}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = loads_strict(arguments)
        except ValueError:
            return BadToolCall("the tool call's arguments string is not JSON")
    if not isinstance(arguments, dict):
        return BadToolCall("a tool call's arguments must be a JSON object")
    return ToolCall(obj["name"], arguments)

"""Hermes-style tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format Qwen-family chat templates (and NousResearch's Hermes function calling) put in assistant turns; the
parser is pure and total: every block between the tags is reported, as a call or as the reason it is not one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a call: its text and why (what a tool message tells the model)."""

    text: str
    problem: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last block runs to the end of the text).

    A block is a call when it holds one JSON object with a string ``name`` and an object ``arguments`` (a JSON
    string holding an object is accepted too, as some models emit it); anything else is a :class:`MalformedCall`,
    also JSON nested past the interpreter's recursion limit or with an integer past its digit limit (never an
    exception: the model's text is untrusted input).
    """
    calls: list[ToolCall | MalformedCall] = []
    for match in _BLOCK.finditer(text):
        body = match.group(1).strip()
        calls.append(_parse_block(body))
    return calls


def _parse_block(body: str) -> ToolCall | MalformedCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedCall(body, f"not JSON: {error.msg} at character {error.pos}")
    except RecursionError:  # nesting deeper than the interpreter's stack allows
        return MalformedCall(body, "not JSON this parser takes: nested too deeply")
    except ValueError as error:  # an integer past the interpreter's digit limit
        return MalformedCall(body, f"not JSON this parser takes: {error}")
    if not isinstance(payload, dict):
        return MalformedCall(body, "expected a JSON object with 'name' and 'arguments'")
    name, arguments = payload.get("name"), payload.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedCall(body, "'name' must be a non-empty string")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError, ValueError):
            return MalformedCall(body, "'arguments' is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return MalformedCall(body, "'arguments' must be a JSON object")
    return ToolCall(name, arguments)

"""Chat messages as plain immutable records, and the model's tool calls in its text (no HTTP, no gRPC).

OpenAI's chat messages (``role``, ``content`` as a string or text parts, ``tool_calls`` on assistant messages,
``tool_call_id`` on tool messages) become :class:`Message` records, canonical so that two renderings of the same
conversation compare equal whatever a framework did to their JSON (``None`` vs ``""`` content, tool-call arguments
as differently spaced JSON, tool-call ids it rewrote). Tool calls are Hermes-style blocks in the model's text,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what Qwen-family templates and SmolLM2's examples use).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as canonical JSON (sorted keys, no spaces)."""

    name: str
    arguments: str

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_template(self) -> dict[str, Any]:
        """The call as chat templates read it (``arguments`` an object)."""
        return {"type": "function", "function": {"name": self.name, "arguments": json.loads(self.arguments)}}


@dataclass(frozen=True)
class Message:
    """One chat message, canonical: ``content`` "" when absent, tool calls without their ids."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None


def canonical_json(text: str, field: str) -> str:
    """``text`` (a JSON object) re-serialised with sorted keys and no spaces.

    Raises:
        InvalidRequest: not a JSON object (``field`` named).
    """
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as error:
        raise InvalidRequest(field, f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise InvalidRequest(field, "must be a JSON object")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content(value: Any, field: str) -> str:
    """A message's content: a string, None, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{field}[{i}]", "only text parts are accepted ({'type': 'text', 'text': ...})")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(field, "must be a string, null or a list of text parts")


def _tool_calls(value: Any, field: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(field, "must be a list")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{field}[{i}].function", "must be an object with a string 'name'")
        arguments = function.get("arguments", "{}")
        arguments = json.dumps(arguments) if isinstance(arguments, Mapping) else arguments
        calls.append(ToolCall(function["name"], canonical_json(arguments, f"{field}[{i}].function.arguments")))
    return tuple(calls)


def parse_messages(raw: Sequence[Any], field: str = "messages") -> tuple[Message, ...]:
    """OpenAI chat messages as :class:`Message` records.

    Raises:
        InvalidRequest: an empty list, a message that is not an object, an unknown role, content that is not text,
            malformed tool calls (the field named, e.g. ``messages[2].content``).
    """
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise InvalidRequest(field, "must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(where, "must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role", f"must be one of {sorted(ROLES)}, not {role!r}")
        name = message.get("name")
        messages.append(Message(
            role="system" if role == "developer" else role, content=_content(message.get("content"), f"{where}.content"),
            tool_calls=_tool_calls(message.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else (),
            name=name if isinstance(name, str) else None,
        ))
    return tuple(messages)


def parse_reply(text: str) -> Message:
    """The assistant message a completion's text (special tokens skipped) stands for: its Hermes tool-call blocks
    as :class:`ToolCall` records (blocks that are not a JSON object with a string ``name`` stay in the content),
    the rest as content (stripped when there were calls)."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            payload = json.loads(match.group(1).strip())
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return match.group(0)
        arguments = payload.get("arguments", {})
        try:
            arguments = canonical_json(arguments if isinstance(arguments, str) else json.dumps(arguments), "arguments")
        except InvalidRequest:
            return match.group(0)
        calls.append(ToolCall(payload["name"], arguments))
        return ""

    content = _BLOCK.sub(take, text)
    return Message("assistant", content.strip() if calls else content, tuple(calls))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(8)}"

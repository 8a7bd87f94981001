"""Chat messages to token ids with the policy's chat template, whole or as a token-exact continuation.

A fresh conversation is the template's rendering of every message plus the generation prompt. A conversation that
extends one the model answered keeps the ids it already has (the prompt and the sampled completion, never
re-encoded) and appends the new messages as the template would: the ids it writes after an end-of-turn token, then
the messages' rendering as differences of renderings (:class:`~services.experience.pipeline.episodes.
ObservationRenderer`'s method, for several messages at once).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.common.errors import InvalidRequest
from services.experience.gateway.messages import Message
from services.experience.pipeline.episodes import ObservationRenderer

_BASE = (Message("user", "."),)


class ChatRenderer:
    """Token ids of chat conversations under one tokenizer's chat template (module docs).

    Raises:
        ValueError: (at construction) a template whose renderings are not prefixes of each other.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._observations = ObservationRenderer(tokenizer)
        template = tokenizer.chat_template or ""
        self._native_tool_calls = "tool_calls" in template  # else calls are written into the content, Hermes-style

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """The whole conversation and the generation prompt.

        Raises:
            InvalidRequest: the template refused the messages (``messages``).
        """
        return self._ids(messages, tools)

    def continuation_ids(self, appended: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """What follows a sampled turn that ended with end-of-turn: the template's separator, ``appended`` (user or
        tool messages) and the generation prompt.

        Raises:
            InvalidRequest: the template renders these messages by rewriting what comes before them.
        """
        base = self._ids(_BASE, tools, generation_prompt=False)
        full = self._ids((*_BASE, *appended), tools)
        if full[: len(base)] != base:
            raise InvalidRequest("messages", "the chat template rewrites the conversation before these messages")
        return [*self._observations.after_turn, *full[len(base):]]

    def _ids(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None,
             generation_prompt: bool = True) -> list[int]:
        try:
            text = self._tokenizer.apply_chat_template(
                [self._template_message(m) for m in messages], tools=list(tools) if tools else None,
                add_generation_prompt=generation_prompt, tokenize=False,
            )
        except Exception as error:  # jinja's errors: the template refused these messages
            raise InvalidRequest("messages", f"the chat template cannot render them: {error}") from error
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template_message(self, message: Message) -> dict[str, Any]:
        rendered: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls and self._native_tool_calls:
            rendered["tool_calls"] = [call.to_template() for call in message.tool_calls]
        elif message.tool_calls:
            blocks = "".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
                             for c in message.tool_calls)
            rendered["content"] = f"{message.content}\n{blocks}" if message.content else blocks
        if message.name is not None:
            rendered["name"] = message.name
        return rendered

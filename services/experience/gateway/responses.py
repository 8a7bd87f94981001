"""OpenAI response bodies from the gateway's answers: chat completions, their stream chunks, text completions.

vLLM's token-in/token-out extensions ride along when asked (``return_token_ids``): ``prompt_token_ids`` on the
response and ``token_ids`` on each choice, exactly the ids the model was given and sampled.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from services.experience.gateway.core import Answer
from services.experience.gateway.messages import new_call_id
from services.experience.gateway.recording import Choice
from services.experience.gateway.requests import Generation

Decode = Callable[[tuple[int, ...]], list[str]]


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _finish(choice: Choice) -> str:
    if choice.reply.tool_calls and choice.finish_reason == "stop":
        return "tool_calls"
    return "length" if choice.finish_reason == "length" else "stop"


def _message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.reply.content or None}
    if choice.reply.tool_calls:
        message["tool_calls"] = [call.to_openai(new_call_id()) for call in choice.reply.tool_calls]
    return message


def _chat_logprobs(choice: Choice, decode: Decode) -> dict[str, Any]:
    return {"content": [
        {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        for token, logprob in zip(decode(choice.token_ids), choice.log_probs, strict=True)
    ]}


def _usage(answer: Answer) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in answer.choices)
    return {"prompt_tokens": len(answer.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(answer.prompt_ids) + completion}


def chat_body(answer: Answer, generation: Generation, decode: Decode) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    choices = []
    for index, choice in enumerate(answer.choices):
        entry: dict[str, Any] = {"index": index, "message": _message(choice), "finish_reason": _finish(choice),
                                 "logprobs": _chat_logprobs(choice, decode) if generation.logprobs else None}
        if generation.return_token_ids:
            entry["token_ids"] = list(choice.token_ids)
        choices.append(entry)
    body = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": answer.model, "choices": choices, "usage": _usage(answer)}
    if generation.return_token_ids:
        body["prompt_token_ids"] = list(answer.prompt_ids)
    return body


def chat_chunks(body: dict[str, Any], generation: Generation, include_usage: bool) -> Iterator[dict[str, Any]]:
    """A finished ``chat.completion`` as ``chat.completion.chunk`` objects: per choice its content (and tool calls,
    log-probs, token ids) in one delta, then its finish reason; a usage chunk last when asked."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    for choice in body["choices"]:
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        entry = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        if generation.return_token_ids:
            entry["token_ids"] = choice["token_ids"]
        yield {**head, "choices": [entry]}
        yield {**head, "choices": [{"index": choice["index"], "delta": {}, "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}]}
    if include_usage:
        yield {**head, "choices": [], "usage": body["usage"]}


def completion_body(answer: Answer, generation: Generation, decode: Decode, text: Callable[[Choice], str]) -> dict:
    """A ``text_completion`` object; ``logprobs`` in the legacy shape (``tokens``, ``token_logprobs``)."""
    choices = []
    for index, choice in enumerate(answer.choices):
        logprobs = None
        if generation.logprobs:
            tokens = decode(choice.token_ids)
            logprobs = {"tokens": tokens, "token_logprobs": list(choice.log_probs), "top_logprobs": None,
                        "text_offset": list(_offsets(tokens))}
        entry: dict[str, Any] = {"index": index, "text": text(choice), "logprobs": logprobs,
                                 "finish_reason": "length" if choice.finish_reason == "length" else "stop"}
        if generation.return_token_ids:
            entry["token_ids"] = list(choice.token_ids)
            entry["prompt_token_ids"] = list(answer.prompt_ids)
        choices.append(entry)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": answer.model, "choices": choices, "usage": _usage(answer)}


def _offsets(tokens: list[str]) -> Iterator[int]:
    """Each token's character offset in the completion text."""
    offset = 0
    for token in tokens:
        yield offset
        offset += len(token)


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...``)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()

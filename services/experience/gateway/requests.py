"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) decoded into plain records.

Every field is checked here, and a bad one is :class:`~services.common.errors.InvalidRequest` naming it (HTTP 400 in
OpenAI's error shape). Fields OpenAI clients send that change nothing here (``user``, ``parallel_tool_calls``,
``metadata``, ``store``, zero penalties) are accepted; ones fastexp cannot honour token-exactly (``stop`` strings,
penalties, ``top_logprobs``, JSON ``response_format``, ``echo``) are refused rather than ignored. vLLM's extensions:
``return_token_ids``, ``top_k``, ``min_tokens``, ``ignore_eos``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastexp.sampling import InvalidSampling, SamplingOptions
from services.common.errors import InvalidRequest
from services.experience.gateway.messages import Message, parse_messages

MAX_N = 16


@dataclass(frozen=True)
class Generation:
    """What both endpoints share: the model named, the sampling, ``n`` choices, ``max_tokens`` (None: the rest of
    the context), streaming, and what to return beside the text."""

    model: str
    sampling: SamplingOptions
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool


@dataclass(frozen=True)
class ChatRequest:
    generation: Generation
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None  # None: no tools (or tool_choice "none")


@dataclass(frozen=True)
class CompletionRequest:
    generation: Generation
    prompt: str | tuple[int, ...]


#: SamplingOptions fields by the name OpenAI requests give them.
_OPENAI_NAMES = {"min_new_tokens": "min_tokens", "max_new_tokens": "max_tokens"}

def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidRequest(name, f"must be a number in [{low}, {high}]")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise InvalidRequest(name, f"must be an integer >= {low}" + (f" and <= {high}" if high is not None else ""))
    return value


def _refuse(body: Mapping[str, Any]) -> None:
    """Fields that would change the output in ways the gateway cannot reproduce token-exactly."""
    if body.get("stop"):
        raise InvalidRequest("stop", "stop strings are not supported (the model's end-of-turn token ends a reply)")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise InvalidRequest(name, "penalties are not supported")
    if body.get("logit_bias"):
        raise InvalidRequest("logit_bias", "not supported")
    if body.get("top_logprobs"):
        raise InvalidRequest("top_logprobs", "only the sampled tokens' log-probs are returned (logprobs: true)")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidRequest("response_format", "only {'type': 'text'} is supported")
    if body.get("echo"):
        raise InvalidRequest("echo", "not supported")


def _generation(body: Mapping[str, Any], logprobs: bool) -> Generation:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model", "must be a non-empty string")
    _refuse(body)
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    try:
        sampling = SamplingOptions(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
            top_k=max(0, _integer(body, "top_k", 0, -1) or 0),  # vLLM: -1 (or 0) is no top-k
            min_new_tokens=int(_integer(body, "min_tokens", 0, 0) or 0), seed=_integer(body, "seed", None, 0),
            skip_special_tokens=True, ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except InvalidSampling as error:  # a range the record itself checks (e.g. a seed past 2**64 - 1)
        raise InvalidRequest(_OPENAI_NAMES.get(error.field, error.field), error.reason) from None
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise InvalidRequest("stream_options", "must be an object")
    return Generation(
        model=model, sampling=sampling, n=int(_integer(body, "n", 1, 1, MAX_N) or 1), max_tokens=max_tokens,
        stream=bool(body.get("stream", False)), include_usage=bool(options.get("include_usage", False)),
        logprobs=logprobs, return_token_ids=bool(body.get("return_token_ids", False)),
    )


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) and t.get("type") == "function"
                                              and isinstance(t.get("function"), Mapping) for t in tools):
        raise InvalidRequest("tools", "must be a list of {'type': 'function', 'function': {...}}")
    if choice not in (None, "auto", "none"):
        raise InvalidRequest("tool_choice", "only 'auto' and 'none' are supported")
    return None if choice == "none" or not tools else tuple(dict(t) for t in tools)


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body as a :class:`ChatRequest`.

    Raises:
        InvalidRequest: the body is not an object, or a field is invalid or unsupported (named).
    """
    if not isinstance(body, Mapping):
        raise InvalidRequest("body", "must be a JSON object")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest("logprobs", "must be a boolean")
    return ChatRequest(_generation(body, bool(logprobs)), parse_messages(body.get("messages")), _tools(body))


def parse_completion(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` body as a :class:`CompletionRequest` (one prompt: a string or token ids).

    Raises:
        InvalidRequest: as :func:`parse_chat`; ``prompt`` a list of several prompts.
    """
    if not isinstance(body, Mapping):
        raise InvalidRequest("body", "must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("prompt", "must be one non-empty string or one list of token ids")
    logprobs = _integer(body, "logprobs", None, 0, 1)
    return CompletionRequest(_generation(body, logprobs is not None), prompt)

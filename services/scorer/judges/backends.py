"""Where a judge's prompts go: the :class:`JudgeBackend` protocol, its records, and the OpenAI-compatible backend
(httpx; the generator backend is :mod:`services.scorer.judges.generator_backend`).

A backend answers one *call* (``prompts_per_call`` prompts at most) within ``timeout_s`` seconds. It raises
:class:`~services.scorer.outbound.guard.SourceUnavailable` when the endpoint did not answer usefully (timeout,
connection error, HTTP 5xx or 429: retried, counted by the breaker) and
:class:`~services.scorer.outbound.guard.SourceRejected` when it refused the call (HTTP 4xx) or answered in a shape
that is not the protocol's. Cancelling a call closes its HTTP requests (the server sees the connection end).

OpenAI-compatible: ``POST {url}/chat/completions`` with ``{model, messages, max_tokens, temperature}`` (and
``logprobs``/``top_logprobs: 20`` for yes/no verdicts), one request per prompt, as ``vllm serve`` and most
inference servers speak it; ``usage`` gives the tokens.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from fastexp.security import read_file
from services.common.bodies import ACCEPT_ENCODING, ReplyTooLarge, read_capped
from services.scorer.judges.config import JudgeConfig
from services.scorer.outbound.guard import SourceRejected, SourceUnavailable

#: Candidates asked for a yes/no verdict's first token.
TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Chat:
    """One judgement's messages: the system message ('' for none) and the rendered template."""

    system: str
    user: str

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style messages."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.user}
        ]


@dataclass(frozen=True)
class JudgeReply:
    """A judge's answer: its text, tokens spent, and (when asked) its first token's candidates' log-probs (nats)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    first_token_logprobs: Mapping[str, float] | None = None


class JudgeBackend(Protocol):
    """A judge endpoint (module docs)."""

    where: str  # for errors: "openai http://judge:8000/v1", "generator host:port"
    prompts_per_call: int

    async def start(self) -> None:
        """Open connections; the endpoint is not contacted (it may start after the scorer)."""
        ...

    async def complete(self, chats: Sequence[Chat], timeout_s: float) -> list[JudgeReply]:
        """One answer per chat, in order, within ``timeout_s`` seconds.

        Raises:
            SourceUnavailable: timeout, connection error, 5xx/429. SourceRejected: 4xx, or an answer off-protocol.
        """
        ...

    async def close(self) -> None: ...


class OpenAIBackend:
    """An OpenAI-compatible chat completions endpoint (module docs); a call is one prompt."""

    prompts_per_call = 1

    def __init__(self, config: JudgeConfig) -> None:
        self._config = config
        self._endpoint = f"{(config.url or '').rstrip('/')}/chat/completions"
        self.where = f"openai {config.url}"
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        slots = self._config.budget.max_concurrency
        headers = {"Accept-Encoding": ACCEPT_ENCODING, **self._config.headers}
        if self._config.token_file is not None:
            headers["Authorization"] = f"Bearer {read_file(self._config.token_file, 'token_file').decode().strip()}"
        verify = True if self._config.tls_ca_file is None else ssl.create_default_context(
            cafile=str(self._config.tls_ca_file))
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots), headers=headers,
            verify=verify,
        )

    async def complete(self, chats: Sequence[Chat], timeout_s: float) -> list[JudgeReply]:
        return list(await asyncio.gather(*(self._one(chat, timeout_s) for chat in chats)))

    async def _one(self, chat: Chat, timeout_s: float) -> JudgeReply:
        assert self._client is not None, "start() first"
        config = self._config
        body: dict[str, object] = {
            "model": config.model, "messages": chat.messages(), "max_tokens": config.answer_tokens,
            "temperature": config.temperature,
        }
        if config.verdict.kind == "yes_no":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client.stream("POST", self._endpoint, json=body, timeout=timeout_s) as response:
                    content = await read_capped(response, config.max_response_bytes)
        except (TimeoutError, httpx.TimeoutException):
            raise SourceUnavailable(f"no answer within {timeout_s:.2f} s", timeout=True) from None
        except httpx.TransportError as error:
            raise SourceUnavailable(f"{type(error).__name__}: {error}") from None
        except ReplyTooLarge as error:  # it answered, with more than a verdict can be: not an outage
            raise SourceRejected(str(error)) from None
        text = content[:200].decode(errors="replace")
        if response.status_code >= 500 or response.status_code == 429:
            raise SourceUnavailable(f"HTTP {response.status_code}: {text}")
        if response.status_code >= 400:
            raise SourceRejected(f"HTTP {response.status_code}: {text}")
        return _reply(content)

    async def close(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()


def _reply(content: bytes) -> JudgeReply:
    """A chat completion's answer. Raises SourceRejected: not one."""
    try:
        body = json.loads(content)
        choice = body["choices"][0]
        text = choice["message"]["content"] or ""
        usage = body.get("usage") or {}
    except (ValueError, KeyError, IndexError, TypeError):
        raise SourceRejected(f"not a chat completion: {content[:200]!r}") from None
    logprobs = None
    candidates = ((choice.get("logprobs") or {}).get("content") or [{}])[0].get("top_logprobs")
    if isinstance(candidates, list):
        logprobs = {str(c.get("token", "")): float(c.get("logprob", float("-inf"))) for c in candidates}
    return JudgeReply(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), logprobs)


def build_backend(config: JudgeConfig) -> JudgeBackend:
    """The backend ``config`` names (not started)."""
    if config.backend == "openai":
        return OpenAIBackend(config)
    from services.scorer.judges.generator_backend import GeneratorBackend

    return GeneratorBackend(config)

"""Answers of outbound HTTP calls read within a size: a reward endpoint or a judge that answers with more than it
should is refused before its whole answer is held in memory (the declared length first, then the bytes as they
arrive)."""

from __future__ import annotations

import httpx


class ReplyTooLarge(Exception):
    """The answer body passed its cap (not retried: it would again)."""


async def read_capped(response: httpx.Response, max_bytes: int, setting: str = "max_response_bytes") -> bytes:
    """The body of a streamed ``response``, read until it passes ``max_bytes`` at most.

    Raises:
        ReplyTooLarge: the declared length or the bytes read pass ``max_bytes`` (the message names ``setting``).
    """
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"answer of {declared} bytes, over {setting} ({max_bytes})")
    body = bytearray()
    async for part in response.aiter_bytes():
        body += part
        if len(body) > max_bytes:
            raise ReplyTooLarge(f"answer passed {setting} ({max_bytes}); the rest was not read")
    return bytes(body)

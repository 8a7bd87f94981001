"""Answers of outbound HTTP calls read within a size: a reward endpoint, a judge, a remote sandbox or an agent that
answers with more than it should is refused before its whole answer is held in memory (the declared length first,
then the bytes as they arrive, decoded as they arrive).

A compressed answer is inflated here, at most the room left under the cap at a time (:data:`ACCEPT_ENCODING`: gzip
and deflate): httpx's own decoding inflates each network chunk whole, and 64 KiB of gzip'd zeros is 64 MiB. An
answer in an encoding not asked for (``br``, ``zstd``, ...) is refused unread."""

from __future__ import annotations

import zlib

import httpx

#: The ``Accept-Encoding`` the callers send: the encodings :func:`read_capped` inflates within the cap.
ACCEPT_ENCODING = "gzip, deflate"
#: zlib's window bits that read either a zlib (deflate) or a gzip stream.
_ZLIB_OR_GZIP = 32 + zlib.MAX_WBITS


class ReplyTooLarge(Exception):
    """The answer body passed its cap, or came in an encoding that cannot be read within it (not retried: it
    would again)."""


async def read_capped(response: httpx.Response, max_bytes: int, setting: str = "max_response_bytes") -> bytes:
    """The body of a streamed ``response``, decoded, read until it passes ``max_bytes`` at most (decoded bytes).

    Raises:
        ReplyTooLarge: the declared length or the bytes read pass ``max_bytes`` (the message names ``setting``),
            or the body is in an encoding other than gzip or deflate (or is not valid in it).
    """
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"answer of {declared} bytes, over {setting} ({max_bytes})")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip", "x-gzip", "deflate"):
        raise ReplyTooLarge(f"answer encoded as {encoding!r}, which is not read (asked for {ACCEPT_ENCODING})")
    inflate = None if encoding in ("identity", "") else zlib.decompressobj(_ZLIB_OR_GZIP)
    body = bytearray()
    async for raw in response.aiter_raw():
        if inflate is None:
            body += raw
        else:
            _inflate_into(body, inflate, raw, max_bytes)
        if len(body) > max_bytes:
            raise ReplyTooLarge(f"answer passed {setting} ({max_bytes}); the rest was not read")
    return bytes(body)


def _inflate_into(body: bytearray, inflate, data: bytes, max_bytes: int) -> None:
    """Append what ``data`` inflates to, never more than one byte past ``max_bytes`` in all.

    Raises:
        ReplyTooLarge: ``data`` is not valid gzip or deflate.
    """
    try:
        while data:
            body += inflate.decompress(data, max_bytes + 1 - len(body))
            if len(body) > max_bytes:
                return
            data = inflate.unconsumed_tail
    except zlib.error as error:
        raise ReplyTooLarge(f"answer is not valid gzip or deflate: {error}") from None

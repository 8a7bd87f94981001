"""Answers of outbound HTTP calls read within a size: a reward endpoint, a judge, a remote sandbox or an agent that
answers with more than it should is refused before its whole answer is held in memory (the declared length first,
then the bytes as they arrive, decoded as they arrive).

A compressed answer is inflated here, at most the room left under the cap at a time (:data:`ACCEPT_ENCODING`: gzip
and deflate): httpx's own decoding inflates each network chunk whole, and 64 KiB of gzip'd zeros is 64 MiB. An
answer in an encoding not asked for (``br``, ``zstd``, ...) is refused unread, as is one that goes on past the end
of its compressed stream (those bytes would be held, uncounted) or ends inside it."""

from __future__ import annotations

import zlib

import httpx

#: The ``Accept-Encoding`` the callers send: the encodings :func:`read_capped` inflates within the cap.
ACCEPT_ENCODING = "gzip, deflate"
#: zlib's window bits per encoding: gzip's header, deflate's zlib header (a raw deflate stream, as some servers send
#: it, is tried when that header is missing).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class ReplyTooLarge(Exception):
    """The answer body passed its cap, or came in an encoding that cannot be read within it (not retried: it
    would again)."""


async def read_capped(response: httpx.Response, max_bytes: int, setting: str = "max_response_bytes") -> bytes:
    """The body of a streamed ``response``, decoded, read until it passes ``max_bytes`` at most (decoded bytes).

    Raises:
        ReplyTooLarge: the declared length or the bytes read pass ``max_bytes`` (the message names ``setting``),
            or the body is in an encoding other than gzip or deflate, is not valid in it, ends inside its
            compressed stream or goes on past its end.
    """
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"answer of {declared} bytes, over {setting} ({max_bytes})")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", *_WBITS):
        raise ReplyTooLarge(f"answer encoded as {encoding!r}, which is not read (asked for {ACCEPT_ENCODING})")
    inflater = _Inflater(encoding) if encoding in _WBITS else None
    body = bytearray()
    async for raw in response.aiter_raw():
        if inflater is None:
            body += raw
        else:
            inflater.feed(body, raw, max_bytes)
        if len(body) > max_bytes:
            raise ReplyTooLarge(f"answer passed {setting} ({max_bytes}); the rest was not read")
    if inflater is not None and not inflater.ended:
        raise ReplyTooLarge(f"answer ends inside its {encoding} stream")
    return bytes(body)


class _Inflater:
    """A gzip or deflate stream inflated into a body, never more than one byte past the cap in all."""

    def __init__(self, encoding: str) -> None:
        self._encoding = encoding
        self._inflate = zlib.decompressobj(_WBITS[encoding])
        self._started = False

    @property
    def ended(self) -> bool:
        return self._inflate.eof

    def feed(self, body: bytearray, data: bytes, max_bytes: int) -> None:
        """Append what ``data`` inflates to, up to one byte past ``max_bytes`` in ``body``.

        Raises:
            ReplyTooLarge: not valid in the encoding, or data past the stream's end.
        """
        if self._inflate.eof and data:
            raise ReplyTooLarge(f"answer goes on past the end of its {self._encoding} stream")
        try:
            self._inflate_into(body, data, max_bytes)
        except zlib.error as error:
            if self._started or self._encoding != "deflate":
                raise ReplyTooLarge(f"answer is not valid {self._encoding}: {error}") from None
            self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)  # a raw deflate stream, without zlib's header
            try:
                self._inflate_into(body, data, max_bytes)
            except zlib.error as raw_error:
                raise ReplyTooLarge(f"answer is not valid deflate: {raw_error}") from None
        self._started = True
        if self._inflate.unused_data:
            raise ReplyTooLarge(f"answer goes on past the end of its {self._encoding} stream")

    def _inflate_into(self, body: bytearray, data: bytes, max_bytes: int) -> None:
        while data and not self._inflate.eof:
            body += self._inflate.decompress(data, max_bytes + 1 - len(body))
            if len(body) > max_bytes:
                return
            data = self._inflate.unconsumed_tail

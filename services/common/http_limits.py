"""Every HTTP edge bounds a request before reading it: :class:`BoundedBody`, an ASGI middleware, checks the
caller first (401 before one byte of the body is read), refuses a declared ``Content-Length`` over the limit (413,
unread), and stops reading a body sent without one (chunked) as soon as it passes the limit (413). The way nginx
(``client_max_body_size``, 1 MiB by default) and the Kubernetes API server (3 MiB) bound bodies; FastAPI itself
reads and parses the whole body before any dependency (an auth check) runs. A body must also arrive whole within
``body_timeout_s`` of the request's head (:data:`BODY_TIMEOUT_S`, 60 s: past it 408), so that a caller cannot hold
its connection open with a body sent a byte at a time (nginx bounds the time between reads: ``client_body_timeout``).

Used by the sandbox server, the experience service's OpenAI-compatible gateway and the reference reward server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Collection

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Default seconds a request's body has to arrive whole, from the moment its head did.
BODY_TIMEOUT_S = 60.0


class BoundedBody:
    """ASGI middleware over ``app`` (module docs): bodies up to ``max_bytes``, whole within ``body_timeout_s``
    seconds; ``authorized(headers)`` (None: no check) decides before the body is read, except on ``open_paths``
    (health). Refusals are JSON ``{"detail": ...}`` (FastAPI's shape), or ``error_body(status, message)`` when
    given (e.g. OpenAI's)."""

    def __init__(self, app: ASGIApp, max_bytes: int, authorized: Callable[[Headers], bool] | None = None,
                 open_paths: Collection[str] = ("/health",),
                 error_body: Callable[[int, str], dict] | None = None, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.authorized, self.open_paths = app, max_bytes, authorized, frozenset(open_paths)
        self.error_body = error_body or (lambda status, message: {"detail": message})
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.authorized is not None and scope["path"] not in self.open_paths and not self.authorized(headers):
            await self._refuse(send, 401, "authorization: a valid bearer token is required")
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send, 413, f"the request body is over {self.max_bytes} bytes")
            return
        received, started, refused, whole = 0, False, False, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def refuse(status: int, message: str) -> Message:
            nonlocal refused  # answer now; the app sees the client gone and its answer is dropped
            refused = True
            if not started:
                await self._refuse(send, status, message)
            return {"type": "http.disconnect"}

        async def bounded_receive() -> Message:
            nonlocal received, whole
            if refused:
                return {"type": "http.disconnect"}
            if whole:  # after the body: the app waits for the client to leave, as long as it likes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await refuse(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.max_bytes:
                    return await refuse(413, f"the request body is over {self.max_bytes} bytes")
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except Exception:
            if not refused:  # the app's own failure
                raise

    async def _refuse(self, send: Callable[[Message], Awaitable[None]], status: int, message: str) -> None:
        body = json.dumps(self.error_body(status, message)).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *extra]})
        await send({"type": "http.response.body", "body": body})


def bearer_check(tokens: Collection[bytes]) -> Callable[[Headers], bool]:
    """``authorized(headers)``: the ``Authorization: Bearer`` token is one of ``tokens`` (compared in constant
    time); always true without tokens."""
    import hmac

    def authorized(headers: Headers) -> bool:
        if not tokens:
            return True
        scheme, _, presented = (headers.get("authorization") or "").partition(" ")
        key = presented.strip().encode() if scheme.lower() == "bearer" else b""
        return any(hmac.compare_digest(key, token) for token in tokens)

    return authorized

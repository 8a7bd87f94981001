"""Work that must end whole even when its caller gives up, and uploads refused without losing their status.

A gRPC handler is cancelled when its client goes away or its deadline passes. Some of what it starts must not stop
halfway (an engine that has paused to load weights; an adapter that a worker has started to keep), and what the
handler holds for it (a staging folder, a lock that keeps a second update out) must outlive it. ``asyncio.shield``
keeps the work running but returns to the caller at once, who then releases those; :func:`run_to_end` waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def run_to_end(work: Awaitable[T], what: str) -> T:
    """Await ``work`` until it ends, even if the caller is cancelled meanwhile; then return its result, or raise
    its error, or, when the caller was cancelled, ``CancelledError`` (logged as ``what`` going on; ``work``'s error,
    if any, is logged too: nobody is left to read it).

    Raises:
        asyncio.CancelledError: the caller was cancelled (raised once ``work`` has ended).
        Whatever ``work`` raises.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # a cancelled wait leaves the task running
        except asyncio.CancelledError:
            if not cancelled:
                logger.info("%s goes on to its end: its caller has gone", what)
            cancelled = True
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("%s failed after its caller had gone", what, exc_info=task.exception())
        raise asyncio.CancelledError
    return task.result()


#: How long a refused upload's remaining messages are read and dropped (seconds), at most.
LINGER_S = 10.0


@contextlib.asynccontextmanager
async def lingering(messages: AsyncIterator[Any], linger_s: float = LINGER_S) -> AsyncIterator[None]:
    """Refuse a client-streaming call cleanly: when the body raises (a bad upload, refused mid-stream), read and drop
    what the client still sends, for up to ``linger_s`` seconds, before the error ends the call.

    grpc.aio's client reports INTERNAL ("Internal error from Core") instead of the server's status when one of its
    writes finds the call already closed, so a client still sending would lose the INVALID_ARGUMENT that names the
    field. Reading on until the client has sent everything (bounded) lets it see the real status: what HTTP servers
    call a lingering close (nginx's ``lingering_close``).

    Raises:
        Whatever the body raises (after the drain).
    """
    try:
        yield
    except Exception:
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(linger_s):
                async for _ in messages:
                    pass
        raise

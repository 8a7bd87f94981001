"""Per-source budgets: a concurrency limit and token buckets on requests/min and tokens/min (aiolimiter), like verl's
``limited`` reward manager. A call over budget queues until it fits or the request's deadline passes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from aiolimiter import AsyncLimiter

from services.common.deadlines import Deadline
from services.common.errors import UpstreamTimeout
from services.common.metrics import SOURCE_BUDGET_WAIT_SECONDS
from services.scorer.outbound.config import BudgetConfig

#: A call still queued this many seconds before its deadline gives up (:class:`BudgetTimeout`): the same margin an
#: outbound call keeps (:meth:`Deadline.timeout`), so the error naming the budget reaches the caller before the
#: caller's own RPC deadline cancels the request.
QUEUE_MARGIN_S = 0.25


class BudgetTimeout(UpstreamTimeout):
    """The request's deadline passed while a call queued for its source's budget (DEADLINE_EXCEEDED's kind)."""


class Budget:
    """One source's budget, owned by that source (module docs). Limiters are made per event loop on first use."""

    def __init__(self, name: str, config: BudgetConfig) -> None:
        self.name = name
        self._config = config
        self._slots: asyncio.Semaphore | None = None
        self._requests: AsyncLimiter | None = None
        self._tokens: AsyncLimiter | None = None

    def _limiters(self) -> tuple[asyncio.Semaphore, AsyncLimiter | None, AsyncLimiter | None]:
        if self._slots is None:
            config = self._config
            self._slots = asyncio.Semaphore(config.max_concurrency)
            self._requests = AsyncLimiter(config.requests_per_minute, 60) if config.requests_per_minute else None
            self._tokens = AsyncLimiter(config.tokens_per_minute, 60) if config.tokens_per_minute else None
        return self._slots, self._requests, self._tokens

    @contextlib.asynccontextmanager
    async def slot(self, tokens: int, deadline: Deadline) -> AsyncIterator[None]:
        """Hold one call's place: a request and ``tokens`` from the buckets (a call larger than a whole minute's
        tokens takes the whole minute's), then a concurrency slot, released when the block ends.

        Raises:
            BudgetTimeout: ``deadline`` (less :data:`QUEUE_MARGIN_S`) passed while waiting; nothing is held.
        """
        slots, requests, token_bucket = self._limiters()
        started = time.perf_counter()
        remaining = deadline.remaining()
        try:  # given up QUEUE_MARGIN_S before the deadline: the caller still hears why, before its RPC is cancelled
            async with asyncio.timeout(None if remaining is None else max(remaining - QUEUE_MARGIN_S, 0.0)):
                if requests is not None:
                    await requests.acquire()
                if token_bucket is not None:
                    await token_bucket.acquire(min(float(tokens), token_bucket.max_rate))
                await slots.acquire()
        except TimeoutError:
            waited = time.perf_counter() - started
            raise BudgetTimeout(
                f"the request's deadline passed after {waited:.2f} s queued for the budget ({self._describe()})"
            ) from None
        SOURCE_BUDGET_WAIT_SECONDS.labels(self.name).observe(time.perf_counter() - started)
        try:
            yield
        finally:
            slots.release()

    def _describe(self) -> str:
        config = self._config
        parts = [f"max_concurrency {config.max_concurrency}"]
        if config.requests_per_minute:
            parts.append(f"requests_per_minute {config.requests_per_minute:g}")
        if config.tokens_per_minute:
            parts.append(f"tokens_per_minute {config.tokens_per_minute:g}")
        return ", ".join(parts)

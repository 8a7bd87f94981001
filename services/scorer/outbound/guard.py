"""The path of every outbound call of a networked source: breaker -> budget -> the call -> outcome recorded.

:class:`CallGuard` is owned by one source. ``async with guard.attempt(tokens, deadline, timeout_s) as timeout:``
wraps one try: it queues for the budget within the deadline (:class:`~.budgets.BudgetTimeout`), yields the try's
timeout (``timeout_s`` capped by the deadline), and records what the block's end says: a normal exit is a success,
an exception of the source's ``failures`` kinds (:class:`SourceUnavailable` and any the source adds) a failure, a
cancellation or anything else no outcome. :meth:`CallGuard.guarded` admits a whole call through the breaker (refused
at once while it is open: :class:`~.breaker.BreakerOpen`) and records its outcome once, after its tries;
:meth:`CallGuard.call` puts both together with retries (stamina, capped exponential backoff with jitter) within the
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import stamina

from services.common.deadlines import Deadline
from services.common.errors import UpstreamTimeout
from services.common.metrics import SOURCE_CALL_SECONDS, SOURCE_CALLS, SOURCE_IN_FLIGHT
from services.scorer.outbound.breaker import Breaker, BreakerOpen
from services.scorer.outbound.budgets import Budget, BudgetTimeout
from services.scorer.outbound.config import BreakerConfig, BudgetConfig

T = TypeVar("T")

#: Seconds before the request's deadline at which a call stops waiting for its next try. Each try ends 0.25 s before
#: it (:meth:`Deadline.timeout`'s margin), but a backoff drawn after a failed try may end past it: the wait is cut
#: here, and the call fails as its last try did while the answer can still reach the caller.
RETRY_STOP_MARGIN_S = 0.125


def after_tries(error: SourceUnavailable) -> str:
    """``after N tries`` for a call that failed (``error.tries``: the tries :meth:`CallGuard.call` sent)."""
    return f"after {error.tries} {'try' if error.tries == 1 else 'tries'}"


class SourceUnavailable(Exception):
    """The endpoint did not answer usefully: timeout, connection error, 5xx (retried; counts against the breaker).
    ``timeout`` says which outcome the metrics record; ``tries``: how many tries of the call were sent, once
    :meth:`CallGuard.call` gives up (0 before)."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.tries = 0


class SourceRejected(Exception):
    """The endpoint answered but refused the call (HTTP 4xx other than 429): not retried, not an outage."""


class CallGuard:
    """One source's breaker and budget, and its call metrics (module docs).

    Args:
        name: the source (metric label, error prefix).
        failures: exception kinds that count as the endpoint failing (besides :class:`SourceUnavailable`).
        clock: the breaker's monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, name: str, budget: BudgetConfig, breaker: BreakerConfig,
                 failures: tuple[type[BaseException], ...] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.breaker = Breaker(name, breaker, clock)
        self.budget = Budget(name, budget)
        self._failures = (SourceUnavailable, *failures)

    @contextlib.asynccontextmanager
    async def guarded(self) -> AsyncIterator[None]:
        """One call, its retries included: the breaker admits it once and records its outcome once, after the
        last try (docs/reward-teams/judges.md: a failed call is one that failed after its retries). A call whose
        tries ended in :class:`SourceRejected` got an answer; a cancelled one, or one whose deadline passed before
        a try was sent, counts neither way.

        Raises:
            BreakerOpen: refused (nothing was sent).
        """
        try:
            admission = self.breaker.admit()
        except BreakerOpen:
            SOURCE_CALLS.labels(self.name, "breaker_open").inc()
            raise
        try:
            yield
        except self._failures as error:
            self.breaker.failed(admission, str(error) or type(error).__name__)
            raise
        except SourceRejected:
            self.breaker.succeeded(admission)  # it answered: up, but said no
            raise
        except BaseException:  # cancelled, a deadline passed in the budget's queue, or not the endpoint's doing
            self.breaker.abandoned(admission)
            raise
        self.breaker.succeeded(admission)

    @contextlib.asynccontextmanager
    async def attempt(self, tokens: int, deadline: Deadline, timeout_s: float) -> AsyncIterator[float]:
        """One try of a call (inside :meth:`guarded`): the budget's slot and the try's metrics. Yields the try's
        timeout in seconds: ``timeout_s`` capped by ``deadline`` (:meth:`Deadline.timeout`), taken once the slot is
        held. A try the deadline leaves no time to send is not a try: it counts in no outcome.

        Raises:
            BudgetTimeout: the deadline passed in the queue. UpstreamTimeout: no time left to send the try.
        """
        calls = SOURCE_CALLS
        sent = False
        try:
            async with self.budget.slot(tokens, deadline):
                timeout = deadline.timeout(timeout_s)
                sent = True
                started = time.perf_counter()
                SOURCE_IN_FLIGHT.labels(self.name).inc()
                try:
                    yield timeout
                finally:
                    SOURCE_IN_FLIGHT.labels(self.name).dec()
                    SOURCE_CALL_SECONDS.labels(self.name).observe(time.perf_counter() - started)
        except UpstreamTimeout as error:
            if isinstance(error, BudgetTimeout):
                calls.labels(self.name, "budget_timeout").inc()
            elif sent:
                calls.labels(self.name, "timeout").inc()
            raise
        except asyncio.CancelledError:
            calls.labels(self.name, "cancelled").inc()
            raise
        except self._failures as error:
            timeout = getattr(error, "timeout", False) or "Timeout" in type(error).__name__
            calls.labels(self.name, "timeout" if timeout else "error").inc()
            raise
        except SourceRejected:
            calls.labels(self.name, "rejected").inc()
            raise
        except BaseException:
            calls.labels(self.name, "error").inc()
            raise
        calls.labels(self.name, "ok").inc()

    async def call(self, send: Callable[[float], Awaitable[T]], *, tokens: int, deadline: Deadline, timeout_s: float,
                   max_attempts: int, backoff_initial_s: float, backoff_max_s: float) -> T:
        """``await send(timeout)`` as one :meth:`guarded` call, each try an :meth:`attempt` (``timeout``: the try's
        seconds, ``timeout_s`` capped by the deadline), retried on :class:`SourceUnavailable` up to ``max_attempts``
        tries while the deadline allows.

        Raises:
            SourceUnavailable: the last try failed, also where the deadline left no time for the next one, or its
                backoff would have ended past the deadline (the call failed: the breaker counts it). BreakerOpen, BudgetTimeout: see :meth:`guarded`,
                :meth:`attempt` (not retried; a first try that never started counts neither way).
        """
        retries = stamina.retry_context(
            on=SourceUnavailable, attempts=max_attempts, timeout=deadline.remaining(),
            wait_initial=backoff_initial_s, wait_max=backoff_max_s,
        )
        remaining = deadline.remaining()
        stop_s = None if remaining is None else max(0.0, remaining - RETRY_STOP_MARGIN_S)
        last: SourceUnavailable | None = None
        tries = 0
        async with self.guarded():
            try:
                async with asyncio.timeout(stop_s):  # a backoff past the deadline is cut (RETRY_STOP_MARGIN_S)
                    async for attempt in retries:
                        with attempt:
                            try:
                                async with self.attempt(tokens, deadline, timeout_s) as timeout:
                                    tries += 1
                                    result = await send(timeout)
                            except SourceUnavailable as error:
                                last = error
                                last.tries = tries
                                raise
            except (UpstreamTimeout, TimeoutError) as error:
                if last is None:  # no try was sent: neither way
                    raise error if isinstance(error, UpstreamTimeout) else UpstreamTimeout(
                        "the request's deadline has passed") from None
                last.tries = tries  # (a later try cut by the deadline was sent too)
                raise last from None  # no time left for another try: the call failed as its last try did
        return result

    def describe(self) -> str:
        """The breaker's state in one line, for error messages."""
        return self.breaker.describe()

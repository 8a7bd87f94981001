"""A circuit breaker per networked reward source: a pure state machine (immutable :class:`BreakerState`, pure
transition functions) and one owner per source (:class:`Breaker`) that keeps the state, its gauge and its log.

Why not a library: ``circuitbreaker`` and ``pybreaker`` decide by exception types around a wrapped function and keep
no bound on half-open calls, ``aiobreaker`` has had no release since 2021. Here the caller decides what a failure is
(a verdict that does not parse is the judge's answer, not an outage), a cancelled call counts neither way, at most
``half_open_probes`` calls are let through while half-open, and the state is a record that metrics, health and
error messages read.

States: CLOSED (calls pass; consecutive failures counted) -> OPEN after ``failure_threshold`` of them (calls
refused) -> HALF_OPEN once ``open_s`` seconds have passed (up to ``half_open_probes`` calls pass) -> CLOSED on a
probe's success, OPEN again on its failure. Times are seconds on the monotonic clock.

Each admitted call carries its :class:`Admission`, the breaker's generation when it was admitted (the generation
moves on every change of status), and only outcomes of the current generation count: while half-open, only its
probes decide; a call sent before the breaker opened, or a probe of a period that already ended (another probe
closed or reopened it), changes nothing when it answers, fails or is cancelled (docs/reward-teams/judges.md).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from services.common.metrics import SOURCE_BREAKER_STATE
from services.scorer.outbound.config import BreakerConfig

logger = logging.getLogger(__name__)


class BreakerStatus(enum.Enum):
    """The breaker's state; ``value`` is what the ``fastexp_reward_source_breaker_state`` gauge shows."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True)
class BreakerState:
    """Where a breaker is: its status, consecutive failures, when it opened (monotonic s), probes in flight, and its
    ``generation`` (moves on every change of status)."""

    status: BreakerStatus = BreakerStatus.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probes: int = 0
    last_error: str = ""
    generation: int = 0


@dataclass(frozen=True)
class Admission:
    """A call admitted in the breaker's ``generation`` (a half-open generation's calls are its probes)."""

    generation: int


def admit(state: BreakerState, now: float, config: BreakerConfig) -> tuple[Admission | None, BreakerState]:
    """The call's admission if it may start now (None: refused), and the state after admitting it (a half-open probe
    is counted)."""
    if not config.enabled or state.status is BreakerStatus.CLOSED:
        return Admission(state.generation), state
    if state.status is BreakerStatus.OPEN:
        if now - state.opened_at < config.open_s:
            return None, state
        half_open = replace(state, status=BreakerStatus.HALF_OPEN, probes=1, generation=state.generation + 1)
        return Admission(half_open.generation), half_open
    if state.probes < config.half_open_probes:
        return Admission(state.generation), replace(state, probes=state.probes + 1)
    return None, state


def succeeded(state: BreakerState, admission: Admission) -> BreakerState:
    """After a call that got an answer: closed, no failures counted, where the call is of the current generation
    (closed: any call; half-open: its probe). A call of an earlier generation changes nothing (one admitted before
    the breaker opened: the source's items keep failing at once for ``open_s``, then a probe decides)."""
    if admission.generation != state.generation or state.status is BreakerStatus.OPEN:
        return state
    if state.status is BreakerStatus.HALF_OPEN:
        return BreakerState(generation=state.generation + 1)
    return replace(state, failures=0, last_error="")


def failed(state: BreakerState, admission: Admission, now: float, config: BreakerConfig, error: str) -> BreakerState:
    """After a call of the current generation that failed (timeout, connection error, 5xx), after its retries: opens
    at the threshold, or on a failed probe; never with ``enabled`` false (failures are still counted, for errors and
    logs). A call of an earlier generation changes nothing."""
    if admission.generation != state.generation or state.status is BreakerStatus.OPEN:
        return state
    failures = state.failures + 1
    if config.enabled and (state.status is BreakerStatus.HALF_OPEN or failures >= config.failure_threshold):
        return BreakerState(BreakerStatus.OPEN, failures, now, 0, error, state.generation + 1)
    return replace(state, failures=failures, last_error=error)


def abandoned(state: BreakerState, admission: Admission) -> BreakerState:
    """After a call that ended without an outcome (cancelled, or its deadline passed while it queued): a probe of
    the current half-open generation frees its place; nothing is counted."""
    if state.status is BreakerStatus.HALF_OPEN and admission.generation == state.generation:
        return replace(state, probes=max(0, state.probes - 1))
    return state


def describe(state: BreakerState, now: float, config: BreakerConfig) -> str:
    """One line for errors and logs, e.g. ``circuit breaker open (5 consecutive failures; next probe in 12.0 s;
    last: ...)``."""
    if not config.enabled:
        return f"circuit breaker off ({state.failures} consecutive failures)"
    if state.status is BreakerStatus.CLOSED:
        return f"circuit breaker closed ({state.failures} consecutive failures of {config.failure_threshold})"
    if state.status is BreakerStatus.HALF_OPEN:
        return f"circuit breaker half-open ({state.probes} probe(s) in flight; last: {state.last_error})"
    wait = max(0.0, config.open_s - (now - state.opened_at))
    return (f"circuit breaker open ({state.failures} consecutive failures; next probe in {wait:.1f} s; "
            f"last: {state.last_error})")


class BreakerOpen(Exception):
    """A call was refused: the source's breaker is open (or half-open with its probes in flight). The message names
    the breaker, its failures and the last error."""


class Breaker:
    """The one owner of a source's :class:`BreakerState`: admits calls, records outcomes, sets the state gauge,
    logs transitions and tells listeners (health) of each status change.

    Args:
        name: the source (the gauge's label).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, name: str, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._config = config
        self._clock = clock
        self._state = BreakerState()
        self._listeners: list[Callable[[BreakerStatus], None]] = []
        SOURCE_BREAKER_STATE.labels(name).set(BreakerStatus.CLOSED.value)

    @property
    def state(self) -> BreakerState:
        """The current state (an immutable record)."""
        return self._state

    def listen(self, listener: Callable[[BreakerStatus], None]) -> None:
        """Call ``listener(status)`` on every status change from now on (on the event loop's thread)."""
        self._listeners.append(listener)

    def admit(self) -> Admission:
        """Let one call start; its outcome is recorded with the admission returned.

        Raises:
            BreakerOpen: the breaker refuses calls now; the message describes it.
        """
        admission, state = admit(self._state, self._clock(), self._config)
        self._set(state)
        if admission is None:
            raise BreakerOpen(self.describe())
        return admission

    def succeeded(self, admission: Admission) -> None:
        """The call admitted as ``admission`` got an answer."""
        self._set(succeeded(self._state, admission))

    def failed(self, admission: Admission, error: str) -> None:
        """The call admitted as ``admission`` failed (the endpoint is down, slow or erroring)."""
        self._set(failed(self._state, admission, self._clock(), self._config, error))

    def abandoned(self, admission: Admission) -> None:
        """The call admitted as ``admission`` ended without an outcome (cancelled)."""
        self._set(abandoned(self._state, admission))

    def describe(self) -> str:
        """The state in one line (see :func:`describe`)."""
        return describe(self._state, self._clock(), self._config)

    def _set(self, state: BreakerState) -> None:
        before, self._state = self._state.status, state
        if state.status is before:
            return
        SOURCE_BREAKER_STATE.labels(self.name).set(state.status.value)
        log = logger.warning if state.status is BreakerStatus.OPEN else logger.info
        log("%s: %s", self.name, self.describe())
        for listener in self._listeners:
            listener(state.status)

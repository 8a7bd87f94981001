"""Runs' running statistics in the state store: the pipeline's ``RunStatistics``
(:mod:`services.experience.pipeline.statistics`) over rows shared by every replica and kept across restarts."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from sqlalchemy.engine import Connection

from fastexp.rl.running import KLController, RunningMoments, RunState, carried_over
from services.experience.state import rows
from services.experience.state.store import StateStore

T = TypeVar("T")


class Key(Protocol):
    """Whose statistics (``services.experience.pipeline.statistics.StatisticsKey``)."""

    run_id: str
    principal: str | None


def to_state(statistics: rows.Statistics, initial: RunState) -> RunState:
    """The :class:`RunState` a stored row holds, carried over onto the request's ``initial`` (its KL target and
    horizon; beta's value from the row once the controller has moved it)."""
    if statistics.reward_count == 0 and statistics.kl_coef is None:
        return initial
    stored = RunState(RunningMoments(statistics.reward_count, statistics.reward_mean, statistics.reward_m2),
                      KLController(initial.kl.value if statistics.kl_coef is None else statistics.kl_coef))
    return carried_over(stored, initial)


def to_row(state: RunState) -> rows.Statistics:
    """The row of ``state``: its moments and beta (the KL target and horizon are the requests' own)."""
    moments = state.reward_moments
    return rows.Statistics(moments.count, moments.mean, moments.m2, state.kl.value)


class StoredStatistics:
    """Runs' statistics in ``store``: each batch's step reads and writes its key's row in one transaction, the row
    locked meanwhile (two replicas' streams of one run take turns); at most ``keep`` caller-scoped keys are kept
    (the least recently written go first)."""

    def __init__(self, store: StateStore, keep: int = 1024, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._keep = keep
        self._clock = clock

    async def advance(self, key: Key, initial: RunState, step: Callable[[RunState], tuple[RunState, T]]) -> T:
        return await self._store.transact("running statistics", functools.partial(self._advance, key, initial, step))

    def _advance(self, key: Key, initial: RunState, step: Callable[[RunState], tuple[RunState, T]],
                 connection: Connection) -> T:
        stored = rows.select_statistics(connection, run_id=key.run_id, principal=key.principal, lock=True)
        state, result = step(to_state(stored, initial))
        rows.write_statistics(connection, to_row(state), self._clock(), run_id=key.run_id, principal=key.principal,
                              keep=self._keep)
        return result

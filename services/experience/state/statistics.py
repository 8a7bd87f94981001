"""Runs' running statistics in the state store: the pipeline's ``RunStatistics``
(:mod:`services.experience.pipeline.statistics`) over rows shared by every replica and kept across restarts."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from sqlalchemy.engine import Connection

from fastexp.rl.running import KLController, RunningMoments, RunState, carried_over
from services.experience.state import rows, stream_rows
from services.experience.state.store import StateStore

T = TypeVar("T")


class Key(Protocol):
    """Whose statistics (``services.experience.pipeline.statistics.StatisticsKey``)."""

    run_id: str
    principal: str | None


class GroupsCounted(Protocol):
    """A resumable stream's groups a batch counted (``services.experience.pipeline.streams.GroupsCounted``)."""

    @property
    def stream(self) -> stream_rows.Key: ...

    @property
    def prompt_indices(self) -> tuple[int, ...]: ...

    @property
    def open_number(self) -> int: ...


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
    locked meanwhile (two replicas' streams of one run take turns), with the groups it counted for a resumable
    stream's record; at most ``keep`` caller-scoped keys are kept (the least recently written go first)."""

    def __init__(self, store: StateStore, keep: int = 1024, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._keep = keep
        self._clock = clock

    async def advance(self, key: Key, initial: RunState, step: Callable[[RunState, frozenset[int]], tuple[RunState, T]],
                      counted: GroupsCounted | None = None) -> T:
        return await self._store.transact("running statistics",
                                          functools.partial(self._advance, key, initial, step, counted))

    def _advance(self, key: Key, initial: RunState, step: Callable[[RunState, frozenset[int]], tuple[RunState, T]],
                 counted: GroupsCounted | None, connection: Connection) -> T:
        stored = rows.select_statistics(connection, run_id=key.run_id, principal=key.principal, lock=True)
        # what the stream counted, read under its row's lock: an open that broke may have committed a batch since
        already = frozenset() if counted is None else stream_rows.counted(connection, counted.stream,
                                                                           counted.open_number)
        state, result = step(to_state(stored, initial), already)
        now = self._clock()
        rows.write_statistics(connection, to_row(state), now, run_id=key.run_id, principal=key.principal,
                              keep=self._keep)
        if counted is not None:  # with the statistics or not at all: a group is counted once
            stream_rows.count_groups(connection, counted.stream, counted.prompt_indices, now)
        return result

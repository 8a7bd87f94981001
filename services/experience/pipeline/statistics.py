"""The running statistics a run carries from batch to batch and request to request (reward moments and the
adaptive KL coefficient, :class:`~fastexp.rl.running.RunState`), behind one interface.

Whose statistics a stream advances is a :class:`StatisticsKey`: a created run's own (every token that may stream
the run shares them), or, for a ``run_id`` no run was created for, that id *scoped to the calling token*: another
token streaming the same id keeps statistics of its own and can neither read nor write these. A request without
``run_id`` keeps them for itself (the stream's own, in memory).

:class:`RunStatistics` is what the pipeline asks: ``advance`` reads the state, lets one batch's estimate step it,
and stores the result, as one step that no other stream of the key interleaves with (a row lock in the state
store: :class:`services.experience.state.statistics.StoredStatistics`, shared by every experience replica and kept
across restarts). :class:`MemoryStatistics` is the same for one process (in-process makers and tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from cachetools import LRUCache

from fastexp.rl.running import KLController, RunningMoments, RunState, carried_over
from services.experience.config import ExperienceConfig
from services.experience.pipeline.streams import GroupsCounted, MemoryStreams

T = TypeVar("T")
#: A batch's statistics step: (the key's state, the groups its stream already counted) -> (new state, result).
Step = Callable[[RunState, frozenset[int]], tuple[RunState, T]]


@dataclass(frozen=True)
class StatisticsKey:
    """Whose statistics: ``run_id``'s; ``principal`` None for a created run's own, else the caller's scope."""

    run_id: str
    principal: str | None = None


def initial_state(config: ExperienceConfig) -> RunState:
    """The state a key starts from: no rewards seen, beta at the request's ``kl_coef`` (its target and horizon)."""
    kl = config.kl
    return RunState(RunningMoments(), KLController(kl.kl_coef, kl.kl_target, kl.kl_horizon))


class RunStatistics(Protocol):
    """Where the pipeline keeps runs' statistics (module docs)."""

    async def advance(self, key: StatisticsKey, initial: RunState, step: Step[T],
                      counted: GroupsCounted | None = None) -> T:
        """Read ``key``'s state (``initial`` when none is stored: a first batch), run ``step`` on it and the groups
        ``counted``'s stream already counted (none without ``counted``; the batch's estimate: returns the new
        state and its result), store the new state and add ``counted``'s groups to its stream's record, return
        the result; all of it one step, atomic per key and stream (:mod:`~services.experience.pipeline.streams`).

        Raises:
            NotReady: the store is unavailable (nothing was stored; the batch is not delivered).
            NotFound: the created run was deleted while its stream ran.
        """
        ...


class MemoryStatistics:
    """:class:`RunStatistics` in this process's memory: the latest state of at most ``max_runs`` keys (least
    recently used evicted). Not thread-safe: the event loop alone calls it.

    ``streams``: where resumable streams' counted groups are recorded (None: not recorded).

    Raises:
        ValueError: ``max_runs < 1``.
    """

    def __init__(self, max_runs: int = 1024, streams: MemoryStreams | None = None) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be >= 1, got {max_runs}")
        self._states: LRUCache[StatisticsKey, RunState] = LRUCache(maxsize=max_runs)
        self._streams = streams

    def get(self, key: StatisticsKey, initial: RunState) -> RunState:
        """``key``'s state, or ``initial`` for a key not seen yet (or evicted)."""
        state = self._states.get(key)  # a hit counts as a use
        return initial if state is None else carried_over(state, initial)

    async def advance(self, key: StatisticsKey, initial: RunState, step: Step[T],
                      counted: GroupsCounted | None = None) -> T:
        already = (frozenset() if counted is None or self._streams is None
                   else self._streams.counted(counted.stream, counted.open_number))
        state, result = step(self.get(key, initial), already)  # no await between the read and the write
        self._states[key] = state
        if counted is not None and self._streams is not None:
            self._streams.count(counted)
        return result

    def __len__(self) -> int:
        return len(self._states)

"""The latest :class:`~fastexp.rl.running.RunState` of every run the service has seen (bounded, LRU)."""

from __future__ import annotations

from dataclasses import replace

from cachetools import LRUCache

from fastexp.rl.running import RunState


class RunStore:
    """Latest :class:`RunState` per ``run_id``, at most ``max_runs`` of them (least recently used evicted).

    Not thread-safe: the experience pipeline reads and writes it from its event loop only.

    Raises:
        ValueError: ``max_runs < 1``.
    """

    def __init__(self, max_runs: int = 1024) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be >= 1, got {max_runs}")
        self._runs: LRUCache[str, RunState] = LRUCache(maxsize=max_runs)

    def get(self, run_id: str, initial: RunState) -> RunState:
        """The run's state, or ``initial`` for a run not seen yet (or evicted). The KL target and horizon always
        come from ``initial`` (the current request); only beta's value carries over."""
        state = self._runs.get(run_id)  # a hit counts as a use
        if state is None:
            return initial
        return replace(state, kl=replace(initial.kl, value=state.kl.value))

    def put(self, run_id: str, state: RunState) -> None:
        """Store ``state`` as the run's latest, evicting the least recently used run beyond ``max_runs``."""
        self._runs[run_id] = state

    def __len__(self) -> int:
        return len(self._runs)

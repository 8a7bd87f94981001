"""Resumable streams' records in the state store: the pipeline's ``StreamRecords``
(:mod:`services.experience.pipeline.streams`) over the ``streams`` rows every replica shares."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

from services.experience.state import stream_rows
from services.experience.state.store import StateStore


class StoredStreams:
    """Streams' records in ``store``; records unused for ``ttl_s`` seconds go at :meth:`collect`."""

    def __init__(self, store: StateStore, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock

    async def open(self, key: stream_rows.Key, fingerprint: str, start_version: int, delivered: Iterable[int],
                   resume: bool) -> stream_rows.StreamRow:
        return await self._store.transact("MakeExperiences stream", functools.partial(
            stream_rows.open_stream, key=key, fingerprint=fingerprint, start_version=start_version,
            delivered=tuple(delivered), now=self._clock(), resume=resume))

    async def collect(self) -> int:
        """Remove records (and stream-scoped statistics) unused for ``ttl_s``; returns how many went."""
        return await self._store.transact("stream collection", functools.partial(
            stream_rows.collect_streams, unused_since=self._clock() - self._ttl_s))

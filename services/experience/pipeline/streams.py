"""Resumable streams' records (``MakeExperiencesRequest.stream_id``), behind one interface.

A stream with an id has a record, keyed by the id *and the calling token's principal* (another token's stream of
the same id is another stream): the fingerprint of its request (a resume must send the same request), the policy
version its first open started at (``max_staleness`` counts from it on every later open), how often it was opened,
and the prompt groups whose rewards and KL the running statistics have counted. The last is written by
:class:`~services.experience.pipeline.statistics.RunStatistics` in the same step as the statistics themselves, so
a replica killed after counting a batch and before delivering it leaves the record saying so, and the group
regenerated on resume is not counted twice.

:class:`~services.experience.state.streams.StoredStreams` keeps them in the state store (every replica sees them;
they survive restarts); :class:`MemoryStreams` in one process (in-process makers and tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from cachetools import TTLCache

from services.common.errors import FailedPrecondition, InvalidRequest
from services.experience.config import ExperienceRequest

#: The statistics of a stream with no run are scoped to ``stream:<principal>`` (:attr:`StreamKey.statistics_scope`).
STREAM_SCOPE_PREFIX = "stream:"


@dataclass(frozen=True)
class StreamKey:
    """A resumable stream: its client-made id, scoped to the token that opened it."""

    principal: str
    stream_id: str

    @property
    def statistics_scope(self) -> str:
        """The scope (a principal's place) of the statistics of a stream with no run, kept under its
        ``stream_id``: ``stream:<principal>``, which no token's principal is (``anonymous``, ``sha256:...``), so
        they never meet a ``run_id``'s statistics, and are kept as long as the stream's record."""
        return f"{STREAM_SCOPE_PREFIX}{self.principal}"


@dataclass(frozen=True)
class StreamRecord:
    """A stream's record as an open finds it: ``start_version`` (v0), ``opens`` (1 at the first), and the
    message's prompt indices whose groups the statistics counted (``counted``)."""

    start_version: int
    opens: int
    counted: frozenset[int] = frozenset()


@dataclass(frozen=True)
class GroupsCounted:
    """A resumable stream's batch as its statistics step sees it: ``prompt_index`` (B,), each row's message index.

    The step reads what the stream's record counted already *in its own transaction* (an open that broke may
    still be committing a batch while the resumed open runs) and counts only the rows of groups not in it
    (:meth:`mask`); the record then holds the batch's groups (:attr:`prompt_indices`)."""

    stream: StreamKey
    prompt_index: tuple[int, ...]
    open_number: int = 1  # which open of the stream counts (a superseded one is refused: it ends)

    @property
    def prompt_indices(self) -> tuple[int, ...]:
        """The batch's groups (sorted message indices)."""
        return tuple(sorted(set(self.prompt_index)))

    def mask(self, already: frozenset[int]) -> torch.Tensor:
        """(B,) bool: the rows whose group ``already`` (the record's counted groups) lacks."""
        return torch.tensor([i not in already for i in self.prompt_index], dtype=torch.bool)


class StreamRecords(Protocol):
    """Where resumable streams' records live (module docs)."""

    async def open(self, key: StreamKey, fingerprint: str, start_version: int, delivered: Iterable[int],
                   resume: bool) -> StreamRecord:
        """Open ``key``'s stream: create its record (v0 = ``start_version``) or, on a ``resume``, count one more
        open (the record's ``opens`` is this open's number) and add ``delivered`` (groups the client holds were
        counted) to what the statistics counted.

        Raises:
            InvalidRequest: ``stream_id`` names another request of this principal (``fingerprint`` differs), or
                a stream already while this is a first open (no ``resume``).
            NotReady: the store is unavailable.
        """
        ...


def check_fingerprint(stored: str, fingerprint: str, stream_id: str) -> None:
    """Raises InvalidRequest (``stream_id``) when a resume's request is not the one the stream was opened with."""
    if stored != fingerprint:
        raise InvalidRequest("stream_id", f"stream {stream_id!r} was opened with another request: resume it with "
                             "the same request (prompts, sampling, options), or use a new stream_id")


@dataclass
class _Entry:
    fingerprint: str
    record: StreamRecord
    counted: set[int] = field(default_factory=set)


class MemoryStreams:
    """:class:`StreamRecords` in this process's memory, each record kept ``ttl_s`` after its last use (at most
    ``max_streams``). Not thread-safe: the event loop alone calls it."""

    def __init__(self, ttl_s: float = 86400.0, max_streams: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: TTLCache[StreamKey, _Entry] = TTLCache(maxsize=max_streams, ttl=ttl_s, timer=clock)

    async def open(self, key: StreamKey, fingerprint: str, start_version: int, delivered: Iterable[int],
                   resume: bool) -> StreamRecord:
        entry = self._entries.get(key)
        if entry is not None and not resume:
            raise InvalidRequest("stream_id", f"stream {key.stream_id!r} exists: resume it (with resume) or open a "
                                 "new stream with a new stream_id")
        if entry is None:
            entry = _Entry(fingerprint, StreamRecord(start_version, 0))
        check_fingerprint(entry.fingerprint, fingerprint, key.stream_id)
        entry.counted.update(delivered)
        entry.record = replace(entry.record, opens=entry.record.opens + 1)
        self._entries[key] = entry  # (re)starts its time to live
        return replace(entry.record, counted=frozenset(entry.counted))

    def counted(self, key: StreamKey, open_number: int) -> frozenset[int]:
        """The groups ``key``'s statistics counted (none for an unknown or expired stream), for its open
        ``open_number``.

        Raises:
            FailedPrecondition: ``stream_id``: the stream was opened again since: this open ends.
        """
        entry = self._entries.get(key)
        if entry is None:
            return frozenset()
        if entry.record.opens > open_number:
            raise FailedPrecondition(f"stream_id: stream {key.stream_id!r} was resumed (open {entry.record.opens}); "
                                     f"this open ({open_number}) ends")
        return frozenset(entry.counted)

    def count(self, counted: GroupsCounted) -> None:
        """Record a batch's counted groups (:class:`~services.experience.pipeline.statistics.MemoryStatistics`
        calls it in the batch's step)."""
        entry = self._entries.get(counted.stream)
        if entry is not None:
            entry.counted.update(counted.prompt_indices)


def counted_groups(request: ExperienceRequest, prompt_index: Sequence[int]) -> GroupsCounted | None:
    """A batch of rows of ``prompt_index`` (the pipeline's indices, (B,)) as a resumable stream's statistics step
    counts it; None for a stream without ``stream_id`` (every row counts, nothing is recorded)."""
    stream = request.stream
    if stream is None:
        return None
    return GroupsCounted(StreamKey(stream.principal, stream.stream_id),
                         tuple(request.source_index(int(i)) for i in prompt_index), stream.open_number)

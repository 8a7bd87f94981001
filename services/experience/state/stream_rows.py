"""Resumable streams' rows (``streams``): the transactions over them, each inside :meth:`StateStore.transact`.

See :mod:`services.experience.pipeline.streams` for what a record means; this module keeps it in the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fastexp.errors import FailedPrecondition, InvalidRequest
from services.experience.state.schema import scoped_statistics, streams

#: Where the statistics of a stream with no run are kept: principal ``stream:<principal>``, run_id its stream_id
#: (``services.experience.pipeline.streams.StreamKey.statistics_scope``); they go with the stream's record.
STREAM_SCOPE_PREFIX = "stream:"


class Key(Protocol):
    """A stream's key (``services.experience.pipeline.streams.StreamKey``)."""

    principal: str
    stream_id: str


@dataclass(frozen=True)
class StreamRow:
    """A stream's row as an open leaves it."""

    start_version: int
    opens: int
    counted: frozenset[int]


def _where(key: Key) -> tuple[sa.ColumnElement[bool], ...]:
    return streams.c.principal == key.principal, streams.c.stream_id == key.stream_id


def open_stream(connection: Connection, key: Key, fingerprint: str, start_version: int, delivered: Iterable[int],
                now: float, resume: bool) -> StreamRow:
    """Create ``key``'s row (v0 ``start_version``, one open), or on a ``resume`` add an open and ``delivered`` to
    its counted groups (locked meanwhile: opens of one stream take turns). A resume of a stream with no row (it
    expired) starts a new one, counting ``delivered``.

    Raises:
        InvalidRequest: ``stream_id``: the row's request fingerprint is another, or a first open (no ``resume``)
            of an id that names a stream already.
    """
    row = connection.execute(sa.select(streams).where(*_where(key)).with_for_update()).first()
    if row is not None and not resume:
        raise InvalidRequest("stream_id", f"stream {key.stream_id!r} exists: resume it (with resume) or open a new "
                             "stream with a new stream_id")
    if row is None:
        counted = frozenset(delivered)
        connection.execute(streams.insert().values(
            principal=key.principal, stream_id=key.stream_id, fingerprint=fingerprint, start_version=start_version,
            opens=1, counted=json.dumps(sorted(counted)), used_at_unix_s=now))
        return StreamRow(start_version, 1, counted)
    if row.fingerprint != fingerprint:
        raise InvalidRequest("stream_id", f"stream {key.stream_id!r} was opened with another request: resume it "
                             "with the same request (prompts, sampling, options), or use a new stream_id")
    counted = frozenset(json.loads(row.counted)) | frozenset(delivered)
    connection.execute(streams.update().where(*_where(key)).values(
        opens=row.opens + 1, counted=json.dumps(sorted(counted)), used_at_unix_s=now))
    return StreamRow(row.start_version, row.opens + 1, counted)


def counted(connection: Connection, key: Key, open_number: int) -> frozenset[int]:
    """``key``'s counted groups, its row locked until the transaction ends (none when the row is gone), for its
    open ``open_number`` (1, 2, ...).

    Raises:
        FailedPrecondition: ``stream_id``: the stream was opened again since (a resume elsewhere): this open ends.
    """
    row = connection.execute(sa.select(streams.c.counted, streams.c.opens).where(*_where(key)).with_for_update()).first()
    if row is None:
        return frozenset()
    if row.opens > open_number:
        raise superseded(key.stream_id, open_number, row.opens)
    return frozenset(json.loads(row.counted))


def superseded(stream_id: str, open_number: int, opens: int) -> FailedPrecondition:
    """The error of an open whose stream was opened again (its client resumed it elsewhere)."""
    return FailedPrecondition(f"stream_id: stream {stream_id!r} was resumed (open {opens}); this open ({open_number}) "
                              "ends")


def count_groups(connection: Connection, key: Key, prompt_indices: Iterable[int], now: float) -> None:
    """Add ``prompt_indices`` to ``key``'s counted groups (in the transaction that counted them); nothing when the
    row is gone (expired)."""
    row = connection.execute(sa.select(streams.c.counted).where(*_where(key)).with_for_update()).first()
    if row is not None:
        counted = sorted(set(json.loads(row.counted)) | set(prompt_indices))
        connection.execute(streams.update().where(*_where(key)).values(counted=json.dumps(counted),
                                                                       used_at_unix_s=now))


def collect_streams(connection: Connection, unused_since: float) -> int:
    """Remove the rows not used since ``unused_since``, with the statistics of those that had no run; returns how
    many streams went."""
    old = connection.execute(sa.select(streams.c.principal, streams.c.stream_id)
                             .where(streams.c.used_at_unix_s < unused_since)).all()
    for principal, stream_id in old:
        connection.execute(scoped_statistics.delete().where(
            scoped_statistics.c.principal == f"{STREAM_SCOPE_PREFIX}{principal}", scoped_statistics.c.run_id == stream_id))
    connection.execute(streams.delete().where(streams.c.used_at_unix_s < unused_since))
    return len(old)

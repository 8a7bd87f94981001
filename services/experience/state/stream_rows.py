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

from fastexp.errors import InvalidRequest
from services.experience.state.schema import scoped_statistics, streams


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
                now: float) -> StreamRow:
    """Create ``key``'s row (v0 ``start_version``, one open), or on a resume add an open and ``delivered`` to its
    counted groups (locked meanwhile: opens of one stream take turns).

    Raises:
        InvalidRequest: ``stream_id``: the row's request fingerprint is another.
    """
    row = connection.execute(sa.select(streams).where(*_where(key)).with_for_update()).first()
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


def counted(connection: Connection, key: Key) -> frozenset[int]:
    """``key``'s counted groups, its row locked until the transaction ends (none when the row is gone)."""
    row = connection.execute(sa.select(streams.c.counted).where(*_where(key)).with_for_update()).first()
    return frozenset() if row is None else frozenset(json.loads(row.counted))


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
        connection.execute(scoped_statistics.delete().where(scoped_statistics.c.principal == principal,
                                                            scoped_statistics.c.run_id == f"stream/{stream_id}"))
    connection.execute(streams.delete().where(streams.c.used_at_unix_s < unused_since))
    return len(old)

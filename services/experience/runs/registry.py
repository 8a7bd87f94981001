"""The runs of a deployment: frozen :class:`Run` records and their one owner, :class:`RunRegistry`.

A run is a named training job with an owner (the :class:`~services.common.identity.Caller` that created it, by
its token's hash), its adapter (None: the deployment's base model), its limits in force, its adapter's live
version and its running statistics: one row of the state store (:mod:`services.experience.state`), shared by every
experience replica and kept across restarts. The registry is that row's one writer: every change is one
transaction whose checks and write go together (two replicas cannot both create a run id, or both take a run's
last stream slot). The gRPC edge asks it before acting and never keeps its own copy. Decisions are plain
functions (:func:`may_use`, :func:`check_user`, :func:`check_update`) over these records.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.engine import Connection

from fastexp.errors import FailedPrecondition, NotFound, Overloaded, PermissionDenied
from services.common.identity import Caller
from services.common.versions import Live
from services.experience.runs.limits import (
    LoraSpec,
    OperatorLimits,
    RunLimits,
    check_lora,
    check_run_id,
    check_servable,
    resolve_limits,
)
from services.experience.state import rows
from services.experience.state.rows import Statistics
from services.experience.state.store import StateStore


@dataclass(frozen=True)
class Run:
    """One run: ``owner`` is its creator's principal (``"anonymous"`` or ``"sha256:<hex>"``), ``lora`` its adapter
    with defaults filled in (None: the base model), ``limits`` those in force, ``created_at_unix_s`` seconds since
    the Unix epoch."""

    run_id: str
    owner: str
    lora: LoraSpec | None
    limits: RunLimits
    created_at_unix_s: float
    live: Live = Live()  # its adapter's live version and blob (a LoRA run's), an update in progress
    statistics: Statistics = Statistics()  # its running reward moments and adaptive beta

    @property
    def owner_display(self) -> str:
        """The owner as reports show it (:attr:`Caller.display`): never the whole hash."""
        return Caller(self.owner).display


@dataclass(frozen=True)
class RunStatus:
    """A run and its live counts: ``streams_open``, its MakeExperiences streams now."""

    run: Run
    streams_open: int


def may_use(run: Run, caller: Caller) -> bool:
    """Whether ``caller`` may get, stream, update or delete ``run``: its owner, or an admin token."""
    return caller.admin or caller.principal == run.owner


def check_user(run: Run, caller: Caller) -> Run:
    """``run`` when ``caller`` may use it.

    Raises:
        PermissionDenied: naming ``run_id`` (another token's run).
    """
    if not may_use(run, caller):
        raise PermissionDenied(f"run_id: run {run.run_id!r} belongs to another token; only its owner or an admin "
                               "token may use it")
    return run


def check_update(run: Run, caller: Caller) -> Run:
    """``run`` when ``caller`` may update its weights: a user of it (:func:`check_user`), and an admin token for a
    base-model run (its weights are the deployment's, shared by every stream).

    Raises:
        PermissionDenied: naming ``run_id``.
    """
    check_user(run, caller)
    if run.lora is None and not caller.admin:
        raise PermissionDenied(f"run_id: run {run.run_id!r} samples the deployment's base model, whose weights every "
                               "run shares: updating them needs an admin token")
    return run


logger = logging.getLogger(__name__)

T = TypeVar("T")


def _from_row(row: rows.RunRow) -> Run:
    lora = None if row.lora is None else LoraSpec(row.lora[0], row.lora[1], row.lora[2])
    return Run(row.run_id, row.owner, lora, RunLimits(*row.limits), row.created_at_unix_s, row.live, row.statistics)


def _to_row(run: Run) -> rows.RunRow:
    lora = None if run.lora is None else (run.lora.rank, run.lora.alpha, tuple(sorted(run.lora.target_modules)))
    limits = run.limits
    return rows.RunRow(run.run_id, run.owner, run.created_at_unix_s, lora,
                       (limits.max_streams, limits.max_groups_ahead, limits.max_tokens_per_request, limits.weight))


@dataclass(frozen=True)
class ReplicaIdentity:
    """This experience replica in the store: its id (new each start), the address it reports, and how long it
    may stay silent before its stream slots stop counting (``ttl_s``, seconds; it says it is alive every
    ``ttl_s / 3``)."""

    replica_id: str
    address: str = ""
    ttl_s: float = 30.0

    @classmethod
    def new(cls, address: str = "", ttl_s: float = 30.0) -> ReplicaIdentity:
        return cls(uuid.uuid4().hex, address, ttl_s)


class RunRegistry:
    """Every run of the deployment (module docs), within ``limits``, in ``store``; ``replica`` names this replica's
    stream slots; ``clock`` gives times (seconds since the Unix epoch).

    :meth:`statuses` (the metrics scrape's thread) reads the last snapshot :meth:`heartbeat` took."""

    def __init__(self, limits: OperatorLimits, store: StateStore, replica: ReplicaIdentity | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.store = store
        self.replica = replica if replica is not None else ReplicaIdentity.new()
        self._clock = clock
        self._snapshot: tuple[RunStatus, ...] = ()

    def _alive_after(self) -> float:
        return self._clock() - self.replica.ttl_s

    async def create(self, run_id: str, caller: Caller, lora: LoraSpec | None, asked: RunLimits,
                     served_rank: Callable[[], int] = lambda: 0) -> RunStatus:
        """A new run owned by ``caller``; ``served_rank()``: the highest LoRA rank the deployment serves now (asked
        only for a LoRA run).

        Raises:
            InvalidRequest: ``run_id``, ``lora.*`` or ``limits.*`` (named).
            FailedPrecondition: a LoRA run where adapters of its rank are not served.
            AlreadyExists: ``run_id`` is taken (on any replica).
            Overloaded: ``max_runs`` runs exist.
            NotReady: the state store is unavailable (nothing was created).
        """
        check_run_id(run_id)
        lora = check_lora(lora, self.limits) if lora is not None else None
        limits = resolve_limits(asked, self.limits)
        if lora is not None:
            check_servable(lora, served_rank())
        run = Run(run_id, caller.principal, lora, limits, self._clock())
        await self._write("CreateRun", functools.partial(rows.insert_run, row=_to_row(run),
                                                         max_runs=self.limits.max_runs))
        return RunStatus(run, 0)

    async def find(self, run_id: str) -> Run | None:
        """The run ``run_id`` as stored now, whoever owns it (None: no such run). For the service's own use.

        Raises:
            NotReady: the state store is unavailable.
        """
        row = await self.store.transact("reading a run", functools.partial(
            rows.select_run, run_id=run_id, now=self._clock()))
        return None if row is None else _from_row(row)

    async def get(self, run_id: str, caller: Caller) -> RunStatus:
        """The run ``run_id`` now, with its streams open on every replica.

        Raises:
            InvalidRequest: ``run_id`` empty. NotFound: no such run. PermissionDenied: another token's run.
            NotReady: the state store is unavailable.
        """
        if not run_id:
            check_run_id(run_id)  # InvalidRequest: a run needs an id
        now, alive_after = self._clock(), self._alive_after()

        def read(connection) -> tuple[rows.RunRow | None, int]:
            row = rows.select_run(connection, run_id, now)
            return row, rows.count_streams(connection, alive_after).get(run_id, 0) if row else 0

        row, streams = await self.store.transact("GetRun", read)
        if row is None:
            raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
        return RunStatus(check_user(_from_row(row), caller), streams)

    async def list(self, caller: Caller) -> tuple[RunStatus, ...]:
        """The runs ``caller`` may use (all of them for an admin token), by run id.

        Raises:
            NotReady: the state store is unavailable.
        """
        return tuple(status for status in await self._all() if may_use(status.run, caller))

    async def _all(self) -> tuple[RunStatus, ...]:
        now, alive_after = self._clock(), self._alive_after()

        def read(connection) -> tuple[list[rows.RunRow], dict[str, int]]:
            return rows.select_runs(connection, now), rows.count_streams(connection, alive_after)

        found, streams = await self.store.transact("ListRuns", read)
        return tuple(RunStatus(_from_row(row), streams.get(row.run_id, 0)) for row in found)

    def statuses(self) -> tuple[RunStatus, ...]:
        """Every run, by run id, whoever owns it, as of this replica's last change to the runs or its last
        :meth:`heartbeat` (for the service's own reports: metrics; safe from another thread)."""
        return self._snapshot

    async def _write(self, what: str, work: Callable[[Connection], T]) -> T:
        """``work`` in one transaction, then (in it) the snapshot :meth:`statuses` reports."""
        now, alive_after = self._clock(), self._alive_after()

        def write(connection: Connection) -> tuple[T, tuple[RunStatus, ...]]:
            result = work(connection)
            streams = rows.count_streams(connection, alive_after)
            return result, tuple(RunStatus(_from_row(row), streams.get(row.run_id, 0))
                                 for row in rows.select_runs(connection, now))

        result, self._snapshot = await self.store.transact(what, write)
        return result

    async def delete(self, run_id: str, caller: Caller) -> RunStatus:
        """Remove the run ``run_id`` and everything of it in the store (owner, adapter version, statistics);
        returns its last state.

        Raises:
            InvalidRequest, NotFound, PermissionDenied: as :meth:`get`. FailedPrecondition: streams of it are open
            (on any replica). Overloaded: naming ``run_id``: its adapter is being updated. NotReady: the store.
        """
        if not run_id:
            check_run_id(run_id)
        now, alive_after = self._clock(), self._alive_after()

        def delete(connection) -> RunStatus:
            row = rows.select_run(connection, run_id, now, lock=True)
            if row is None:
                raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
            run = check_user(_from_row(row), caller)
            streams = rows.count_streams(connection, alive_after).get(run_id, 0)
            if streams:
                raise FailedPrecondition(f"run_id: run {run_id!r} has {streams} MakeExperiences streams open; "
                                         "delete it once they end")
            if run.lora is not None and run.live.updating:
                raise Overloaded(f"run_id: run {run_id!r}'s adapter is being updated; delete the run once that "
                                 "update has answered")
            rows.delete_run(connection, run_id)
            return RunStatus(run, 0)

        return await self._write("DeleteRun", delete)

    @contextlib.asynccontextmanager
    async def streaming(self, run_id: str, caller: Caller, stream_id: str = "",
                        resume: bool = False) -> AsyncIterator[Run | None]:
        """Hold one of the run's stream slots (in the store: counted on every replica; a resumable stream's slot
        names its ``stream_id``, and its ``resume`` takes over the slots of its earlier opens) for the ``async with``
        block, given back however it ends (a killed replica's slots stop counting after ``ttl_s``). Yields the
        run, or None when ``run_id`` names no run (empty, or an id for running statistics only, scoped to the
        caller): nothing is checked or counted then.

        Raises:
            PermissionDenied: another token's run. Overloaded: naming ``max_streams``. NotReady: the store.
        """
        run = await self.find(run_id) if run_id else None
        if run is None:
            yield None
            return
        check_user(run, caller)
        opening = asyncio.ensure_future(self._write("opening a stream slot", functools.partial(
            rows.open_slot, run_id=run_id, replica_id=self.replica.replica_id, now=self._clock(),
            alive_after=self._alive_after(), stream_key=f"{caller.principal}/{stream_id}" if stream_id else None,
            take_over=resume)))
        try:
            slot = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the stream was cancelled while its slot was being taken: give it back
            opening.add_done_callback(lambda done: None if done.cancelled() or done.exception() else
                                      asyncio.ensure_future(self._close_slot(run_id, done.result())))
            raise
        try:
            yield run
        finally:
            await asyncio.shield(self._close_slot(run_id, slot))

    async def _close_slot(self, run_id: str, slot: str) -> None:
        """Give stream slot ``slot`` back; a failure is logged (it stops counting once this replica is gone)."""
        try:
            await self._write("closing a stream slot", functools.partial(rows.close_slot, slot_id=slot))
        except Exception as error:  # noqa: BLE001 - see the docstring
            logger.warning("run %s: stream slot %s not given back (%s); it counts until this replica stops",
                           run_id, slot, error)

    async def authorize_update(self, run_id: str, caller: Caller) -> Run:
        """The run an UpdateWeights naming ``run_id`` acts on, when ``caller`` may update it (:func:`check_update`).

        Raises:
            InvalidRequest: ``run_id`` empty. NotFound: no such run. PermissionDenied: naming ``run_id``.
            NotReady: the store.
        """
        if not run_id:
            check_run_id(run_id)
        run = await self.find(run_id)
        if run is None:
            raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
        return check_update(run, caller)

    async def heartbeat(self) -> None:
        """Say this replica is alive (its stream slots keep counting), forget replicas silent for ``ttl_s``, and
        take the snapshot :meth:`statuses` reports.

        Raises:
            NotReady: the store.
        """
        now = self._clock()
        await self.store.transact("heartbeat", functools.partial(
            rows.heartbeat, replica_id=self.replica.replica_id, address=self.replica.address, now=now,
            dead_before=now - self.replica.ttl_s))
        self._snapshot = await self._all()

    async def leave(self) -> None:
        """This replica stops: its stream slots are given back at once."""
        await self.store.transact("leaving", functools.partial(rows.leave, replica_id=self.replica.replica_id))

    async def run_heartbeats(self, reachable: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """:meth:`heartbeat` every ``ttl_s / 3`` seconds until cancelled (every second while the store does not
        answer); ``reachable`` is told whether it answered (the service's readiness follows it)."""
        while True:
            try:
                await self.heartbeat()
                answered = True
            except Exception as error:  # noqa: BLE001 - the store is down: reported here and where it is used
                logger.warning("heartbeat to the state store failed: %s", error)
                answered = False
            if reachable is not None:
                await reachable(answered)
            await asyncio.sleep(self.replica.ttl_s / 3 if answered else 1.0)

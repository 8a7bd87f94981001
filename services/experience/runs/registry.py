"""The runs of one experience service: frozen :class:`Run` records and their one owner, :class:`RunRegistry`.

A run is a named training job with an owner (the :class:`~services.common.identity.Caller` that created it, by
its token's hash), its adapter (None: the deployment's base model) and its limits in force. The registry holds
every run and the count of each run's open ``MakeExperiences`` streams; the gRPC edge asks it before acting and
never keeps its own copy. Decisions are plain functions (:func:`may_use`, :func:`check_user`,
:func:`check_stream_room`) over these records.

Not thread-safe: the service's event loop alone calls it, and no method awaits, so a check and what it guards
(counting a stream) happen together.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from fastexp.errors import AlreadyExists, FailedPrecondition, NotFound, Overloaded, PermissionDenied
from services.common.identity import Caller
from services.experience.runs.limits import (
    LoraSpec,
    OperatorLimits,
    RunLimits,
    check_lora,
    check_run_id,
    check_servable,
    resolve_limits,
)


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


def check_stream_room(run: Run, streams_open: int) -> None:
    """Whether ``run`` may open one more stream with ``streams_open`` open.

    Raises:
        Overloaded: naming ``max_streams`` (RESOURCE_EXHAUSTED): the run's streams are all in use.
    """
    if streams_open >= run.limits.max_streams:
        raise Overloaded(f"max_streams: run {run.run_id!r} has {streams_open} MakeExperiences streams open, its "
                         f"max_streams; retry when one ends")


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


class RunRegistry:
    """Every run of the service and each one's open streams (module docs), within ``limits``; ``clock`` gives
    creation times (seconds since the Unix epoch)."""

    def __init__(self, limits: OperatorLimits, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self._clock = clock
        self._runs: dict[str, Run] = {}
        self._streams: dict[str, int] = {}

    def create(self, run_id: str, caller: Caller, lora: LoraSpec | None, asked: RunLimits,
               served_rank: Callable[[], int] = lambda: 0) -> RunStatus:
        """A new run owned by ``caller``; ``served_rank()``: the highest LoRA rank the deployment serves now (asked
        only for a LoRA run).

        Raises:
            InvalidRequest: ``run_id``, ``lora.*`` or ``limits.*`` (named).
            FailedPrecondition: a LoRA run where adapters of its rank are not served.
            AlreadyExists: ``run_id`` is taken.
            Overloaded: ``max_runs`` runs exist.
        """
        check_run_id(run_id)
        lora = check_lora(lora, self.limits) if lora is not None else None
        limits = resolve_limits(asked, self.limits)
        if lora is not None:
            check_servable(lora, served_rank())
        if run_id in self._runs:
            raise AlreadyExists(f"run_id: a run {run_id!r} exists already")
        if len(self._runs) >= self.limits.max_runs:
            raise Overloaded(f"max_runs: this deployment holds {len(self._runs)} runs, as many as its operator "
                             "allows; delete one first")
        run = Run(run_id, caller.principal, lora, limits, self._clock())
        self._runs[run_id] = run
        self._streams[run_id] = 0
        return RunStatus(run, 0)

    def get(self, run_id: str, caller: Caller) -> RunStatus:
        """The run ``run_id`` now.

        Raises:
            InvalidRequest: ``run_id`` empty. NotFound: no such run. PermissionDenied: another token's run.
        """
        run = check_user(self._find(run_id), caller)
        return RunStatus(run, self._streams[run_id])

    def list(self, caller: Caller) -> tuple[RunStatus, ...]:
        """The runs ``caller`` may use (all of them for an admin token), by run id."""
        return tuple(RunStatus(run, self._streams[run_id]) for run_id, run in sorted(self._runs.items())
                     if may_use(run, caller))

    def statuses(self) -> tuple[RunStatus, ...]:
        """Every run, by run id, whoever owns it (for the service's own reports: metrics). Safe to call from
        another thread (the metrics scrape's): it reads a copy, taken at once, and a run deleted meanwhile
        counts no streams."""
        runs = dict(self._runs)  # one C-level copy: the event loop cannot change it half-way
        return tuple(RunStatus(run, self._streams.get(run_id, 0)) for run_id, run in sorted(runs.items()))

    def delete(self, run_id: str, caller: Caller) -> RunStatus:
        """Remove the run ``run_id``; returns its last state.

        Raises:
            InvalidRequest, NotFound, PermissionDenied: as :meth:`get`. FailedPrecondition: streams of it are open.
        """
        status = self.get(run_id, caller)
        if status.streams_open:
            raise FailedPrecondition(f"run_id: run {run_id!r} has {status.streams_open} MakeExperiences streams "
                                     "open; delete it once they end")
        del self._runs[run_id], self._streams[run_id]
        return status

    @contextlib.contextmanager
    def streaming(self, run_id: str, caller: Caller) -> Iterator[Run | None]:
        """Hold one of the run's stream slots for the ``with`` block, released however it ends. Yields the run,
        or None when ``run_id`` names no run (empty, or a name for running statistics only): nothing is checked
        or counted then.

        Raises:
            PermissionDenied: another token's run. Overloaded: naming ``max_streams``.
        """
        run = self._runs.get(run_id) if run_id else None
        if run is None:
            yield None
            return
        check_user(run, caller)
        check_stream_room(run, self._streams[run_id])
        self._streams[run_id] += 1
        try:
            yield run
        finally:
            self._streams[run_id] -= 1  # a run with streams open is never deleted: its count is still here

    def authorize_update(self, run_id: str, caller: Caller) -> Run:
        """The run an UpdateWeights naming ``run_id`` acts on, when ``caller`` may update it (:func:`check_update`).

        Raises:
            InvalidRequest: ``run_id`` empty. NotFound: no such run. PermissionDenied: naming ``run_id``.
        """
        return check_update(self._find(run_id), caller)

    def _find(self, run_id: str) -> Run:
        if not run_id:
            check_run_id(run_id)  # InvalidRequest: a run needs an id
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
        return run

    def __len__(self) -> int:
        return len(self._runs)

"""A generator replica as the fleet sees it: its state, the transitions allowed between states, and its record.

Only :class:`~services.experience.fleet.replicas.ReplicaSet` writes a :class:`Replica` (its state, version, load and
affinity): every state change goes through :func:`next_state`, which checks it against :data:`TRANSITIONS`, and
every change that may let work go somewhere (a replica serving, load dropping, a version moving) is announced on
:class:`Changes`, which waiters wait on instead of polling. Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cachetools import LRUCache

from services.common.deadlines import Deadline
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig
from services.common.weights import ReceivedUpdate
from services.experience.fleet.readiness import GeneratorInfo

if TYPE_CHECKING:
    import torch


class ReplicaState(enum.StrEnum):
    CONNECTING = "connecting"  # not reached yet, or its version is unknown
    SYNCING = "syncing"  # reached at another policy version: being sent the current weights
    SERVING = "serving"  # reached at the fleet's version: gets work
    DOWN = "down"  # stopped answering or failed: its work went elsewhere
    DRAINING = "draining"  # left discovery: no new work, closed once idle


_S = ReplicaState

#: The states a replica may move to from each state (staying where it is is always allowed). A probe brings a
#: replica that is not draining to SERVING, or to SYNCING when it serves another version; failed probes or a failed
#: stream take it DOWN; a weight update or sync whose outcome is unknown makes it CONNECTING (its next probe tells);
#: leaving discovery drains it, from any state; only discovering it again brings a draining replica back.
TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    _S.CONNECTING: frozenset({_S.SYNCING, _S.SERVING, _S.DOWN, _S.DRAINING}),
    _S.SYNCING: frozenset({_S.SERVING, _S.CONNECTING, _S.DOWN, _S.DRAINING}),
    _S.SERVING: frozenset({_S.SYNCING, _S.CONNECTING, _S.DOWN, _S.DRAINING}),
    _S.DOWN: frozenset({_S.SYNCING, _S.SERVING, _S.CONNECTING, _S.DRAINING}),
    _S.DRAINING: frozenset({_S.CONNECTING}),
}


class InvalidTransition(ValueError):
    """A replica asked to move between states :data:`TRANSITIONS` does not connect (a bug in the caller)."""


def next_state(current: ReplicaState, wanted: ReplicaState) -> ReplicaState:
    """``wanted``, when a replica in ``current`` may move there (:data:`TRANSITIONS`).

    Raises:
        InvalidTransition: naming both states.
    """
    if wanted is not current and wanted not in TRANSITIONS[current]:
        raise InvalidTransition(f"a generator replica cannot go from {current} to {wanted}")
    return wanted


class ReplicaClient(Protocol):
    """One generator replica, as :class:`~services.experience.fleet.clients.GeneratorClient` reaches it."""

    async def model_info(self, timeout_s: float) -> GeneratorInfo: ...

    def generate(self, request: GenerationRequest, deadline: Deadline) -> AsyncIterator[CompletionRecord]: ...

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline, version: int | None = None) -> int: ...

    async def load_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], num_tensors: int, version: int, deadline: Deadline
    ) -> int: ...

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int, deadline: Deadline,
        *, weights_digest: str = "",
    ) -> int: ...

    async def unload_adapter(self, name: str, deadline: Deadline) -> bool: ...

    async def set_cpu_threads(self, threads: int, timeout_s: float) -> int: ...

    async def close(self) -> None: ...


def lacks_adapters(info: GeneratorInfo, live: Mapping[str, tuple[int, str | None]], stale: Collection[str] = ()) -> bool:
    """Whether a replica (its ``info``) needs a resync for its adapters: it lacks a live one, holds another
    version of one, or holds it under another digest (``live``: name → (version, digest; None: not by reference)),
    or it still holds one of ``stale``, a deleted run's adapter this replica could not tell it to unload.

    The version numbers of a later run of a deleted run's name start again at 1, so a leftover copy could pass for
    that run's by version: its digest tells it apart, even where the deletion went through another experience
    replica or before a restart (which keep no ``stale`` set of this one's). Other adapters it holds are not
    checked."""
    for name, (version, digest) in live.items():
        if info.adapters.get(name) != version or (digest is not None and info.adapter_digests.get(name) != digest):
            return True
    return any(name in info.adapters for name in stale)


#: Sends the live policy's weights to a replica: ``source(client, version)`` with ``version()`` the version to
#: label them with (read once no update is being applied), and every LoRA run's live adapter it lacks; returns the
#: version the replica serves afterwards.
WeightSource = Callable[[ReplicaClient, Callable[[], int]], Awaitable[int]]


class Stream(Protocol):
    """A fleet stream running on a replica: taking the replica out stops it (:meth:`stop`)."""

    def stop(self, reason: str) -> None: ...


@dataclass(eq=False)
class Replica:
    """One replica's state as the fleet sees it: read by anyone, written only by its
    :class:`~services.experience.fleet.replicas.ReplicaSet` (on the event loop).

    ``outstanding_tokens``: routing's estimate of the tokens its unfinished samples may still process for us;
    ``in_flight_samples``: samples sent to it and not yet received; ``prefixes``: the affinity keys of the prompts
    it served last (least recently used dropped first); ``stale_adapters``: deleted runs' adapters it may still
    hold (its ``UnloadAdapter`` failed), unloaded before it serves again.
    """

    address: str
    client: ReplicaClient
    state: ReplicaState = ReplicaState.CONNECTING
    version: int | None = None  # the policy version it reported last (None: unknown)
    info: GeneratorInfo | None = None
    problem: str = "not reached yet"
    failures: int = 0  # failed probes in a row
    outstanding_tokens: int = 0
    in_flight_samples: int = 0
    streams: set[Stream] = field(default_factory=set)  # the fleet's streams running on it
    prefixes: LRUCache[str, None] = field(default_factory=lambda: LRUCache(maxsize=4096))
    stale_adapters: set[str] = field(default_factory=set)
    watcher: asyncio.Task[None] | None = None

    def warm(self, key: str) -> bool:
        """Whether it served a prompt with affinity key ``key`` recently (its prefix is likely cached there)."""
        return key in self.prefixes

    def describe(self) -> str:
        version = "?" if self.version is None else self.version
        detail = f": {self.problem}" if self.problem and self.state is not ReplicaState.SERVING else ""
        return f"{self.address} ({self.state}, version {version}{detail})"


class Changes:
    """Announces that the replicas changed (a state, a version, their load); :meth:`wait_until` waits for a
    condition over them without polling."""

    def __init__(self) -> None:
        self._next = asyncio.Event()

    def notify(self) -> None:
        """Something changed: wake every waiter (each checks its condition again)."""
        self._next.set()
        self._next = asyncio.Event()

    def next(self) -> asyncio.Event:
        """The event set at the next change."""
        return self._next

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, checking it after each change (bound it with ``asyncio.timeout``)."""
        while not condition():
            await self._next.wait()

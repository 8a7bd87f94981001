"""The generator replicas an experience service knows: discovery, health, and bringing each to the live weights.

:class:`ReplicaSet` keeps one :class:`Replica` record per generator service, each reached through its own
:class:`ReplicaClient` (``GeneratorClient``, its own channel):

- **Discovery.** Targets are ``host:port`` (used as given) or ``dns:///name:port``, resolved to every address the
  name has (a Kubernetes headless Service, a Compose service scaled with ``--scale``) and resolved again every
  ``discovery_interval_s``. A replica that appears is probed and used once it serves the current policy version; a
  replica that disappears is drained (no new work; what it runs finishes or, if it dies, is rerouted) and closed.
- **Health.** Each replica is probed (``GetModelInfo``) every ``probe.interval_s`` while up, with capped
  exponential backoff and jitter while down. ``down_after_failures`` failed probes in a row take a serving
  replica out: the streams running on it are stopped, and the fleet sends their groups elsewhere.
- **Version.** The set serves one policy version (the first replica's, then each update's or the state store's:
  :meth:`ReplicaSet.follow`). A replica at any other version, or lacking a LoRA run's live adapter, is first sent
  the live weights and adapters by :attr:`ReplicaSet.weight_source` (from the state store's blobs) and gets work
  only then, so every completion's ``policy_version`` is true.

One owner: only the set writes its :class:`~services.experience.fleet.replica_state.Replica` records. Probes, syncs,
discovery and the fleet's calls (``take_out``, ``begin_work``/``sample_done``/``end_work``, ``update_applied``/
``update_failed``) change them through checked state transitions (``replica_state.TRANSITIONS``), announced on
:attr:`ReplicaSet.changes`: whoever waits for room or a serving replica waits on it, not polls.

Routing, failover and updates over the set: :mod:`~services.experience.fleet.generator_fleet`. Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from cachetools import LRUCache

from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import FastexpError
from services.experience.fleet.discovery import DNS_SCHEME, resolve_targets
from services.experience.fleet.readiness import ProbeSettings, backoff_s
from services.experience.fleet.replica_state import (
    Changes,
    Replica,
    ReplicaClient,
    ReplicaState,
    Stream,
    WeightSource,
    lacks_adapters,
    next_state,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class FleetSettings:
    """How the fleet watches and routes (seconds, counts).

    ``probe``: probe deadline, interval while up, backoff while down; ``down_after_failures``: failed probes in a
    row that take a serving replica out; ``discovery_interval_s``: how often ``dns:///`` targets are resolved
    again; ``affinity_entries``: prompts remembered per replica for prefix affinity; ``sync_timeout_s``: deadline
    of sending the current weights to a replica; ``max_samples_in_flight``: most samples one replica runs for this
    service at once (its engine's batch capacity, e.g. vLLM's ``max_num_seqs``), so groups wait in the fleet and
    go to whichever replica frees up first (``None``: every group is placed at once).
    """

    probe: ProbeSettings = ProbeSettings()
    down_after_failures: int = 2
    discovery_interval_s: float = 10.0
    affinity_entries: int = 4096
    sync_timeout_s: float = 600.0
    max_samples_in_flight: int | None = None


class ReplicaSet:
    """The known replicas and the version they serve (module docs); the one writer of their records.

    ``connect(address)`` opens a replica's client; :meth:`run` keeps discovery and health going until cancelled.
    Set :attr:`weight_source` (and :attr:`live_adapters`, the LoRA runs' settled adapters and versions) before :meth:`run`
    so that replicas at another version, or lacking an adapter, can be brought up to date.
    """

    def __init__(self, targets: Sequence[str], connect: Callable[[str], ReplicaClient],
                 settings: FleetSettings | None = None,
                 resolve: Callable[[Sequence[str]], Awaitable[list[str]]] = resolve_targets) -> None:
        if not targets:
            raise ValueError("a generator fleet needs at least one target address")
        self.targets = tuple(targets)
        self.weight_source: WeightSource | None = None
        self.live_adapters: Callable[[], Mapping[str, tuple[int, str | None]]] = dict  # name → (version, digest)
        self.changes = Changes()  # notified on every change of a replica's state, version or load
        self._probe_now = asyncio.Event()  # set (and replaced) to probe every replica at once
        self._version: int | None = None
        self._pending_version: int | None = None
        self._connect = connect
        self.settings = settings or FleetSettings()
        self._resolve = resolve
        self._replicas: dict[str, Replica] = {}
        self._discovery_problem = ""

    @property
    def version(self) -> int | None:
        """The policy version the set serves (``None``: no replica reached yet)."""
        return self._version

    @property
    def pending_version(self) -> int | None:
        """The version an update being applied makes live (``None``: no update under way)."""
        return self._pending_version

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The replicas known now (any state), by address."""
        return tuple(self._replicas[a] for a in sorted(self._replicas))

    def routable(self, replica: Replica) -> bool:
        """Whether ``replica`` gets new work: serving, not draining, at the fleet's version (or, while an update
        is applied, at the version it makes live)."""
        return (
            replica.state is ReplicaState.SERVING
            and self._version is not None
            and replica.version in (self._version, self._pending_version)
        )

    async def wait_routable(self, min_version: int | None = None) -> Replica:
        """The first replica (by address) that gets work, at policy version ``min_version`` or later, once there
        is one (bound the wait with ``asyncio.timeout``)."""

        def found() -> Replica | None:
            return next((r for r in self.replicas if self.routable(r) and r.version is not None
                         and (min_version is None or r.version >= min_version)), None)

        await self.changes.wait_until(lambda: found() is not None)
        replica = found()
        assert replica is not None
        return replica

    def describe(self) -> str:
        """Each replica's address, state and version, in words (what readiness errors say)."""
        if not self._replicas:
            problem = f": {self._discovery_problem}" if self._discovery_problem else ""
            return f"no generator replica found at {', '.join(self.targets)}{problem}"
        return ", ".join(replica.describe() for replica in self.replicas)

    def _move(self, replica: Replica, state: ReplicaState, problem: str | None = None) -> None:
        """The one place a replica's state changes: checked against the transition table, then announced.

        Raises:
            InvalidTransition: ``replica`` cannot go from its state to ``state`` (a bug).
        """
        replica.state = next_state(replica.state, state)
        if problem is not None:
            replica.problem = problem
        self.changes.notify()

    # --- the fleet's work on a replica ------------------------------------------------------------------------

    def begin_work(self, replica: Replica, stream: Stream, tokens: int, samples: int, prefixes: Iterable[str]) -> None:
        """``stream`` starts on ``replica`` with ``samples`` samples and ``tokens`` of work (routing's estimate);
        ``prefixes``: its prompts' affinity keys, remembered as warm there."""
        if self.settings.affinity_entries > 0:
            for key in prefixes:
                replica.prefixes[key] = None
        replica.outstanding_tokens += tokens
        replica.in_flight_samples += samples
        replica.streams.add(stream)
        self.changes.notify()

    def sample_done(self, replica: Replica, tokens: int) -> None:
        """One sample of a stream on ``replica`` arrived: ``tokens`` of its estimated work are done."""
        replica.in_flight_samples -= 1
        replica.outstanding_tokens -= tokens
        self.changes.notify()

    def end_work(self, replica: Replica, stream: Stream, tokens: int, samples: int) -> None:
        """``stream`` is over on ``replica``: the ``tokens`` and ``samples`` it still held are given back."""
        replica.streams.discard(stream)
        replica.outstanding_tokens -= tokens
        replica.in_flight_samples -= samples
        self.changes.notify()

    # --- policy updates ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """While an update to ``version`` is applied, replicas already at it count as routable too."""
        self._pending_version = version
        try:
            yield
        finally:
            self._pending_version = None
            self.changes.notify()

    def update_applied(self, replicas: Iterable[Replica], version: int) -> None:
        """``replicas`` applied the update to ``version``, which is now the set's."""
        for replica in replicas:
            replica.version = version
        self._version = version
        self.changes.notify()

    def follow(self, version: int) -> None:
        """The state store's live ``version`` changed (an update through another experience replica): the set
        serves it now, and every replica is probed at once (one at another version is synced; its groups wait)."""
        if self._pending_version is None and version != self._version:
            logger.info("generator fleet follows policy version %d (live in the state store)", version)
            self._version = version
            woken, self._probe_now = self._probe_now, asyncio.Event()
            woken.set()
            self.changes.notify()

    def update_failed(self, replica: Replica, reason: str) -> None:
        """``replica`` failed an update: its version is unknown until its next probe (no work until then)."""
        replica.version = None
        self.take_out(replica, ReplicaState.CONNECTING, reason)

    def adapter_loaded(self, replica: Replica, name: str) -> None:
        """``replica`` loaded adapter ``name`` (a live run's): whatever copy of that name it held is replaced."""
        replica.stale_adapters.discard(name)

    def adapter_unload_failed(self, replica: Replica, name: str) -> None:
        """``replica`` could not be told to unload a deleted run's adapter ``name``: it is unloaded there before
        the replica serves again (its next probe sees it and resyncs it)."""
        replica.stale_adapters.add(name)

    # --- discovery and health -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Discover replicas and watch each until cancelled (the service's lifetime)."""
        try:
            while True:
                await self.discover()
                if not any(t.startswith(DNS_SCHEME) for t in self.targets):
                    await asyncio.Event().wait()  # fixed addresses: nothing to resolve again
                await asyncio.sleep(self.settings.discovery_interval_s)
        finally:
            await self._stop_watching()

    async def discover(self) -> None:
        """Resolve the targets once: start watching new replicas, drain the ones that are gone. A failed resolution
        keeps the replicas known so far (a DNS hiccup must not empty the fleet)."""
        try:
            addresses = set(await self._resolve(self.targets))
        except (OSError, ValueError) as error:
            self._discovery_problem = f"resolving {', '.join(self.targets)}: {error}"
            logger.warning("generator discovery failed (keeping %d known replicas): %s", len(self._replicas), error)
            return
        self._discovery_problem = "" if addresses else f"{', '.join(self.targets)} resolved to no address"
        for address in sorted(addresses):
            replica = self._replicas.get(address)
            if replica is None:
                self._add(address)
            elif replica.state is ReplicaState.DRAINING:  # back before it was closed: watch it again
                self._move(replica, ReplicaState.CONNECTING)
                replica.watcher = asyncio.create_task(self._watch(replica), name=f"generator-replica-{address}")
        for address in sorted(self._replicas.keys() - addresses):
            if self._replicas[address].state is not ReplicaState.DRAINING:
                self._drain(self._replicas[address])

    def _add(self, address: str) -> None:
        replica = Replica(address, self._connect(address), prefixes=LRUCache(max(1, self.settings.affinity_entries)))
        self._replicas[address] = replica
        metrics.GENERATOR_REPLICA_UP.labels(address).set_function(lambda: float(self.routable(replica)))
        metrics.GENERATOR_REPLICA_IN_FLIGHT.labels(address).set_function(lambda: replica.in_flight_samples)
        metrics.GENERATOR_REPLICA_VERSION.labels(address).set_function(
            lambda: -1 if replica.version is None else replica.version
        )
        replica.watcher = asyncio.create_task(self._watch(replica), name=f"generator-replica-{address}")
        logger.info("generator replica %s joined the fleet", address)

    def _drain(self, replica: Replica) -> None:
        logger.info("generator replica %s left discovery: draining %d streams", replica.address, len(replica.streams))
        self._move(replica, ReplicaState.DRAINING)
        if replica.watcher is not None:
            replica.watcher.cancel()
        asyncio.create_task(self._close_when_idle(replica), name=f"drain-{replica.address}")

    async def _close_when_idle(self, replica: Replica) -> None:
        await self.changes.wait_until(lambda: not replica.streams or replica.state is not ReplicaState.DRAINING)
        if replica.state is not ReplicaState.DRAINING:
            return  # discovered again meanwhile: it stays
        del self._replicas[replica.address]
        for gauge in (metrics.GENERATOR_REPLICA_UP, metrics.GENERATOR_REPLICA_IN_FLIGHT,
                      metrics.GENERATOR_REPLICA_VERSION):
            with contextlib.suppress(KeyError):
                gauge.remove(replica.address)
        await replica.client.close()
        logger.info("generator replica %s drained and closed", replica.address)

    async def _stop_watching(self) -> None:
        watchers = [r.watcher for r in self._replicas.values() if r.watcher is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)

    async def close(self) -> None:
        """Stop watching and close every replica's channel."""
        await self._stop_watching()
        for replica in list(self._replicas.values()):
            await replica.client.close()

    async def _watch(self, replica: Replica) -> None:
        """Probe ``replica`` for as long as it is in the fleet; bring it to the fleet's version before it serves."""
        settings, attempt = self.settings, 0
        while True:
            try:
                up = await self._probe(replica)
            except Exception:  # noqa: BLE001 - a bug must not stop the watch: report it, try again
                logger.exception("probing generator replica %s failed", replica.address)
                up = False
            if up:
                attempt = 0
                with contextlib.suppress(TimeoutError):  # or at once, when the fleet follows a new version
                    async with asyncio.timeout(settings.probe.interval_s):
                        await self._probe_now.wait()
            else:
                await asyncio.sleep(backoff_s(attempt, settings.probe))
                attempt += 1

    async def _probe(self, replica: Replica) -> bool:
        """One probe (and, when needed, a weight sync); True when the replica answered."""
        try:
            info = await replica.client.model_info(self.settings.probe.timeout_s)
        except FastexpError as error:
            replica.problem = str(error)
            replica.failures += 1
            serving = replica.state is ReplicaState.SERVING
            if replica.state is not ReplicaState.DOWN and (not serving or replica.failures >= self.settings.down_after_failures):
                self.take_out(replica, ReplicaState.DOWN, f"{replica.failures} probes failed: {error}")
            return False
        replica.failures, replica.problem, replica.info = 0, "", info
        replica.version = info.policy_version
        self.changes.notify()  # its version may be the one waited for
        if self._version is None:
            self._version = info.policy_version
            logger.info("generator fleet serves policy version %d (first replica reached: %s)",
                        self._version, replica.address)
        if replica.version not in (self.version, self.pending_version) and self._updated_directly(replica):
            logger.warning(
                "generator %s serves policy version %d, ahead of the %d live here: it was updated directly, not "
                "through this experience service; following it (the actor replica keeps its weights, so "
                "action_log_probs follow those until the next update through this service)",
                replica.address, replica.version, self.version,
            )
            self._version = replica.version
        replica.stale_adapters.intersection_update(info.adapters)  # a copy it no longer holds (it restarted) is gone
        live, stale = self.live_adapters(), replica.stale_adapters
        if replica.version not in (self.version, self.pending_version) or lacks_adapters(info, live, stale):
            await self._sync(replica)
        elif replica.state is not ReplicaState.SERVING:
            self._serve(replica)
        return True

    def _updated_directly(self, replica: Replica) -> bool:
        """A lone generator ahead of the live version (a generator-only update): the single-generator deployment
        follows it, as it always did. In a fleet of several, the experience service's version is the authority and
        such a replica is brought back to it."""
        others = [r for r in self._replicas.values() if r is not replica and r.state is not ReplicaState.DRAINING]
        ahead = self.version is not None and replica.version is not None and replica.version > self.version
        return ahead and not others and self.pending_version is None

    async def _sync(self, replica: Replica) -> None:
        """Unload the deleted runs' adapters ``replica`` may still hold, then send it the fleet's current weights
        and live adapters; it serves once it has them."""
        if self.weight_source is None:
            self._move(replica, ReplicaState.SYNCING,
                       f"serves policy version {replica.version}, the fleet {self.version}; no weight source")
            return
        self._move(replica, ReplicaState.SYNCING)
        logger.info("generator replica %s serves policy version %s, the fleet %s: sending it the current weights",
                    replica.address, replica.version, self.version)
        try:
            for name in sorted(replica.stale_adapters):
                await replica.client.unload_adapter(name, Deadline.from_remaining(self.settings.sync_timeout_s))
                replica.stale_adapters.discard(name)
                logger.info("generator replica %s unloaded deleted run %s's adapter", replica.address, name)
            replica.version = await self.weight_source(replica.client, lambda: self.version)
        except FastexpError as error:
            self._move(replica, ReplicaState.CONNECTING, f"weight sync failed: {error}")
            logger.warning("weight sync of generator replica %s failed: %s", replica.address, error)
            return
        if replica.version == self.version:
            self._serve(replica)

    def _serve(self, replica: Replica) -> None:
        self._move(replica, ReplicaState.SERVING, "")
        logger.info("generator replica %s serving at policy version %s", replica.address, replica.version)

    def take_out(self, replica: Replica, state: ReplicaState, reason: str) -> None:
        """No new work for ``replica``; its running streams stop and their groups go to the others."""
        if replica.state is ReplicaState.DRAINING:
            state = ReplicaState.DRAINING
        was_serving = replica.state is ReplicaState.SERVING
        self._move(replica, state, reason)
        if was_serving or replica.streams:
            logger.warning("generator replica %s taken out (%s): %s; %d streams rerouted",
                           replica.address, state, reason, len(replica.streams))
        else:  # not reached yet, or already out: what it waits for is in readiness's message
            logger.debug("generator replica %s %s: %s", replica.address, state, reason)
        for stream in list(replica.streams):
            stream.stop(reason)


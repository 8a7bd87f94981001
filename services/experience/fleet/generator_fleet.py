"""The generator fleet: prompt groups routed over the replicas, failover without losing a group, weight updates.

:class:`GeneratorFleet` implements the pipeline's :class:`~services.experience.pipeline.events.Generator` over the replicas
of a :class:`~services.experience.fleet.replicas.ReplicaSet` (one replica is today's deployment, unchanged):

- **Routing.** Each prompt group goes whole to one replica, by least outstanding work with prefix affinity as the
  tie-breaker (:mod:`~services.experience.fleet.routing`). Backpressure stays the producer's: its window bounds the
  groups of a stream across the whole fleet.
- **Failover.** Samples are held per group and handed on only once the group's n samples came from one replica,
  so a group whose replica fails (its stream errs, or the set takes the replica out) is generated again, whole,
  on another, and every group reaches the pipeline exactly once; the stream says so with a
  :class:`~services.experience.pipeline.events.Rerouted` notice. With no replica left it fails (NotReady), and the
  pipeline reports the undelivered prompt indices as before. Each held sample is announced as it arrives
  (:class:`~services.experience.pipeline.events.SamplePreview`), so its forward passes can start before its group is whole.
- **Weights.** An update goes to every serving replica in parallel with the version it makes live
  (``WeightsHeader.policy_version``); the version becomes the fleet's once all replicas that stay have it. A
  replica that fails it is taken out (its work rerouted) and brought back by the set's resync. LoRA runs'
  adapters are loaded and, when a run is deleted, unloaded the same way (:mod:`~services.experience.fleet.adapters`).

Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import torch

from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import (
    FailedPrecondition,
    FastexpError,
    InvalidRequest,
    NotReady,
    Overloaded,
    UpstreamTimeout,
)
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig
from services.common.weights import ReceivedUpdate
from services.experience.fleet import adapters
from services.experience.fleet.calls import Call, Ended, Record, SubStream, queue_end, taken_out_error
from services.experience.fleet.discovery import resolve_targets
from services.experience.fleet.readiness import GeneratorInfo
from services.experience.fleet.replicas import (
    FleetSettings,
    Replica,
    ReplicaClient,
    ReplicaSet,
    ReplicaState,
    WeightSource,
)
from services.experience.fleet.routing import group_work, place_groups
from services.experience.pipeline.events import Rerouted, SamplePreview

logger = logging.getLogger(__name__)


class GeneratorFleet:
    """Generator replicas behind one :class:`~services.experience.pipeline.events.Generator` (module docs).

    ``connect(address)`` opens a replica's client; :meth:`run` keeps discovery and health going until cancelled.
    Set :attr:`weight_source` before :meth:`run` so that replicas at another version can be brought up to date.
    """

    def __init__(
        self,
        targets: Sequence[str],
        connect: Callable[[str], ReplicaClient],
        settings: FleetSettings | None = None,
        resolve: Callable[[Sequence[str]], Awaitable[list[str]]] = resolve_targets,
    ) -> None:
        self.members = ReplicaSet(targets, connect, settings, resolve)
        self._stream_ids = itertools.count()

    @property
    def weight_source(self) -> WeightSource | None:
        """What sends a replica the live weights (set it before :meth:`run`)."""
        return self.members.weight_source

    @weight_source.setter
    def weight_source(self, source: WeightSource | None) -> None:
        self.members.weight_source = source

    @property
    def version(self) -> int | None:
        """The policy version the fleet serves (``None`` before a replica was reached)."""
        return self.members.version

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The replicas known now (any state), by address."""
        return self.members.replicas

    def samples_in_flight(self) -> int:
        """Samples this service has submitted to its replicas and not yet received (every stream's)."""
        return sum(replica.in_flight_samples for replica in self.members.replicas)

    async def run(self) -> None:
        """Discover and watch the replicas until cancelled."""
        await self.members.run()

    async def close(self) -> None:
        """Stop watching and close every replica's channel."""
        await self.members.close()

    async def model_info(self, timeout_s: float) -> GeneratorInfo:
        """The fleet's model info (a serving replica's, at the fleet's version, with the ``dtype`` every replica
        reports, "" where they differ or one was never reached); the readiness probe.

        Raises:
            NotReady: no replica serves at the fleet's version; the message lists each replica's state.
        """
        dtypes = {replica.info.dtype if replica.info is not None else "" for replica in self.replicas}
        for replica in self.replicas:
            if self.members.routable(replica) and replica.info is not None:
                assert self.version is not None
                return dataclasses.replace(replica.info, policy_version=self.version,
                                           dtype=dtypes.pop() if len(dtypes) == 1 else "")
        raise NotReady(f"no generator replica serves: {self.members.describe()}")

    async def generate(
        self, request: GenerationRequest, deadline: Deadline
    ) -> AsyncIterator[CompletionRecord | Rerouted | SamplePreview]:
        """Route ``request``'s prompt groups over the replicas; yield each group's n completions together (sample
        order) once all arrived from one replica, and a :class:`Rerouted` notice when a replica's unfinished
        groups were sent elsewhere. Closing the iterator cancels every replica's stream (their engines abort).

        Raises:
            NotReady: no replica left to send unfinished groups to (the message lists the replicas).
            InvalidRequest: a replica rejected the request (every replica would).
            UpstreamTimeout: the request's deadline passed.
        """
        works = [group_work(p, request.n_samples_per_prompt, request.sampling.max_new_tokens) for p in request.prompts]
        if request.affinity_key is not None:  # e.g. an episode's turns: one key, so they stay where their KV is
            works = [dataclasses.replace(w, prefix_key=f"{request.affinity_key}/{i}") for i, w in enumerate(works)]
        call = Call(request, deadline, works)
        try:
            self._dispatch(call)
            while call.unfinished:
                event = await self._next_event(call)
                if event is None:  # groups wait for room that other streams hold, and the replicas changed
                    self._dispatch(call)
                    continue
                if isinstance(event, Record):
                    self._account(event.stream, event.record)
                    whole = call.receive(event.record)
                    if not whole:  # held until its group is whole; its forwards may start now
                        yield SamplePreview(event.record)
                    for completion in whole:
                        yield completion
                    if call.pending and event.record.prompt_index not in call.groups:  # a group done: room
                        self._dispatch(call)
                    continue
                stream = event.stream
                self._end(stream, call.streams)
                lost = [i for i in stream.indices if i in call.unfinished]
                if event.error is None and not lost:
                    self._dispatch(call)
                    continue
                error = event.error or NotReady(f"generator {stream.replica.address}: its stream ended early")
                if not self._reroutable(error, deadline):
                    raise error
                if stream.taken_out is None and not isinstance(error, Overloaded):
                    self.members.take_out(stream.replica, ReplicaState.DOWN, f"Generate failed: {error}")
                call.reroute(lost, stream.replica.address)
                metrics.REROUTED_GROUPS.labels(stream.replica.address).inc(len(lost))
                logger.warning("%s: %d groups rerouted from generator %s (%s)", request.request_id, len(lost),
                               stream.replica.address, stream.taken_out or error)
                yield Rerouted(len(lost), stream.replica.address, str(stream.taken_out or error))
                self._dispatch(call)
        finally:
            for stream in call.streams:
                if stream.task is not None:
                    stream.task.cancel()
            try:
                await asyncio.gather(*(s.task for s in call.streams if s.task is not None), return_exceptions=True)
            finally:  # even when the closing call is cancelled again meanwhile: the replicas' load goes back
                for stream in list(call.streams):
                    self._end(stream, call.streams)

    async def _next_event(self, call: Call) -> Record | Ended | None:
        """The call's next event; ``None`` when, with groups waiting for room, the replicas changed first (a load
        dropped, a replica began serving: :attr:`ReplicaSet.changes`), so they may be placed now."""
        if not call.pending or not call.events.empty():
            return await call.events.get()
        changed = asyncio.ensure_future(self.members.changes.next().wait())
        getting = asyncio.ensure_future(call.events.get())
        try:
            await asyncio.wait({changed, getting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            getting.cancel()  # a get cancelled before it returned leaves its item in the queue
        return getting.result() if getting.done() and not getting.cancelled() else None

    def _coming(self, replica: Replica) -> bool:
        """Being synced, or serving at a version other than the fleet's new one (its next probe, at once, tells)."""
        return replica.state is ReplicaState.SYNCING or (
            replica.state is ReplicaState.SERVING and replica.version != self.members.version)

    def _dispatch(self, call: Call) -> None:
        """Place the call's pending groups on replicas with room and start one stream per replica used.

        Raises:
            NotReady: no routable replica (besides those that failed this call), and none being synced, while groups
                are pending.
        """
        if not call.pending:
            return
        candidates = {r.address: r for r in self.replicas
                      if self.members.routable(r) and r.address not in call.excluded}
        if not candidates and any(self._coming(r) and r.address not in call.excluded for r in self.replicas):
            return  # a replica being brought to (or probed at) the live version serves soon: its groups wait
        if not candidates:
            raise NotReady(
                f"no generator replica left for {len(call.pending)} prompt groups: {self.members.describe()}"
            )
        request, n = call.request, call.request.n_samples_per_prompt
        chosen = place_groups(
            {a: r.outstanding_tokens for a, r in candidates.items()},
            {a: r.in_flight_samples for a, r in candidates.items()},
            [call.works[i] for i in call.pending], n, self.members.settings.max_samples_in_flight,
            lambda group: [a for a, r in candidates.items() if r.warm(group.prefix_key)],
        )
        per_replica: dict[str, list[int]] = {}
        for index, address in zip(call.pending, chosen, strict=True):
            if address is not None:
                per_replica.setdefault(address, []).append(index)
        call.pending = [i for i, address in zip(call.pending, chosen, strict=True) if address is None]
        for address, part in per_replica.items():
            replica = candidates[address]
            stream = SubStream(replica, tuple(part), sum(call.works[i].tokens for i in part),
                                request.sampling.max_new_tokens, len(part) * n)
            sub = dataclasses.replace(
                request,
                request_id=f"{request.request_id}-s{next(self._stream_ids)}",
                prompts=tuple(request.prompts[i] for i in part),
                media=tuple(request.media[i] for i in part) if request.media else (),
            )
            self.members.begin_work(replica, stream, stream.reserved_tokens, stream.samples_left,
                                    [call.works[i].prefix_key for i in part])
            call.streams.add(stream)
            stream.task = asyncio.create_task(self._stream(stream, sub, call.deadline, call.events),
                                              name=sub.request_id)
            stream.task.add_done_callback(functools.partial(queue_end, stream, call.events))

    async def _stream(
        self, stream: SubStream, sub: GenerationRequest, deadline: Deadline, events: asyncio.Queue[Record | Ended]
    ) -> BaseException | None:
        """Read one replica's stream into ``events`` (prompt indices mapped back); its error, if any (the task's
        done callback, :func:`queue_end`, queues its end)."""
        try:
            async with contextlib.aclosing(stream.replica.client.generate(sub, deadline)) as records:
                async for record in records:
                    original = stream.indices[record.prompt_index]
                    events.put_nowait(Record(stream, dataclasses.replace(record, prompt_index=original)))
        except asyncio.CancelledError:
            if stream.taken_out is None:
                raise  # the caller closed the generate call
            return taken_out_error(stream)
        except Exception as exc:  # noqa: BLE001 - a FastexpError is the replica's failure; others generate() raises
            return exc
        return None

    def _account(self, stream: SubStream, record: CompletionRecord) -> None:
        """One sample arrived from ``stream``'s replica: its reserved decode budget is done."""
        stream.samples_left -= 1
        release = min(stream.max_tokens, stream.reserved_tokens - stream.released_tokens)
        stream.released_tokens += release
        self.members.sample_done(stream.replica, release)
        metrics.GENERATOR_REPLICA_TOKENS.labels(stream.replica.address).inc(len(record.output_token_ids))

    def _end(self, stream: SubStream, streams: set[SubStream]) -> None:
        """``stream`` is over: give back what it still held of its replica's load (once)."""
        if stream not in streams:
            return
        streams.discard(stream)
        self.members.end_work(stream.replica, stream, stream.reserved_tokens - stream.released_tokens,
                              stream.samples_left)
        stream.released_tokens = stream.reserved_tokens
        stream.samples_left = 0

    def _reroutable(self, error: BaseException, deadline: Deadline) -> bool:
        """Whether ``error`` from one replica's stream is that replica's failure (send its groups elsewhere) and
        not the request's (raise it)."""
        if isinstance(error, InvalidRequest) and error.reason.startswith("adapter: no adapter named"):
            return True  # it lacks a LoRA run's live adapter (it restarted): taken out, resynced before it serves
        if isinstance(error, InvalidRequest | FailedPrecondition) or not isinstance(error, FastexpError):
            return False  # the request's, or the trainer's doing (a generator it put to sleep): raised as it is
        remaining = deadline.remaining()
        expired = remaining is not None and remaining <= 0
        return not (isinstance(error, UpstreamTimeout) and expired)

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int, deadline: Deadline,
        *, weights_digest: str = "",
    ) -> int:
        """Load a LoRA run's adapter on every serving replica (:func:`~services.experience.fleet.adapters.load_adapter`)."""
        return await adapters.load_adapter(self.members, name, config, tensors, version, deadline,
                                           weights_digest=weights_digest)

    async def unload_adapter(self, name: str, deadline: Deadline | None = None) -> adapters.UnloadOutcome:
        """Free a deleted LoRA run's adapter on every replica by ``deadline`` (default:
        :data:`~services.experience.fleet.adapters.UNLOAD_TIMEOUT_S` from now); never raises for a replica that
        fails (logged and marked: it unloads its copy before it serves again). See
        :func:`~services.experience.fleet.adapters.unload_adapter`."""
        deadline = deadline or Deadline.from_remaining(adapters.UNLOAD_TIMEOUT_S)
        return await adapters.unload_adapter(self.members, name, deadline)

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline, version: int | None = None) -> int:
        """Apply a checked policy update on every serving replica in parallel; ``version`` (default, and
        at least: the fleet's + 1) is the fleet's once every replica that stays has it. Replicas that fail it are taken out (their work
        rerouted) and brought back by a resync.

        Raises:
            NotReady: no replica serves (nothing applied).
            InvalidRequest: every replica rejected it (nothing applied anywhere).
            UpstreamTimeout, Overloaded, NotReady: no replica applied it; replicas whose outcome is unknown are
                probed again and resynced before they get work.
        """
        targets = [r for r in self.replicas if self.members.routable(r)]
        if not targets or self.version is None:
            raise NotReady(f"no generator replica serves to apply the update: {self.members.describe()}")
        if version is None or version <= self.version:  # after a lone generator's direct update, numbers go on
            version = self.version + 1
        with self.members.updating(version):
            results = await asyncio.gather(
                *(r.client.update_weights(update, deadline, version) for r in targets), return_exceptions=True
            )
        applied = [r for r, result in zip(targets, results, strict=True) if not isinstance(result, BaseException)]
        failed = [(r, result) for r, result in zip(targets, results, strict=True) if isinstance(result, BaseException)]
        if not applied:
            errors = [error for _, error in failed]
            if all(isinstance(error, InvalidRequest) for error in errors):
                raise errors[0]
            for replica, error in failed:  # it may or may not have applied it: its next probe tells
                self.members.update_failed(replica, f"weight update failed: {error}")
            raise next((e for e in errors if isinstance(e, FastexpError)), errors[0])
        self.members.update_applied(applied, version)
        for replica, error in failed:
            self.members.update_failed(replica, f"weight update to version {version} failed: {error}")
        return version

"""gRPC adapter of the experience service: decode the request, run the pipeline, encode each batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import grpc

from fastexp.status import (
    DRAINED_KEY,
    FAILED_KEY,
    INVALID_PROMPTS_KEY,
    RUN_ID_KEY,
    STREAM_OPEN_KEY,
    UNDELIVERED_KEY,
)
from fastexp.v1 import experience_pb2, experience_pb2_grpc, generation_pb2
from fastexp.weights import TENSOR_BATCHES
from fastexp.wire import experience_to_pb
from services.common import metrics
from services.common.deadlines import Deadline
from services.common.dtypes import agreed_dtype
from services.common.errors import FailedPrecondition, InvalidRequest, NotReady, Overloaded
from services.common.identity import Caller, current_caller
from services.common.logs import bind_request_id, current_request_id
from services.common.lora import AdapterConfig
from services.common.media import MediaLimits
from services.common.sampling import RequestLimits
from services.common.tasks import lingering, run_to_end
from services.common.weights import TensorSpec, UpdateBounds
from services.common.weights.wire import staged_update
from services.experience.api.prompts import InvalidPrompts
from services.experience.api.request import decode_request
from services.experience.api.runs import RunMethods, check_lora_stream
from services.experience.api.streams import check_stream_fields, request_fingerprint, resumed_request
from services.experience.config import ExperienceRequest, RunBinding, StreamPoint, run_tenant
from services.experience.fleet.readiness import GeneratorInfo
from services.experience.pipeline.events import StreamStats
from services.experience.pipeline.maker import ExperienceMaker
from services.experience.pipeline.statistics import StatisticsKey
from services.experience.pipeline.streams import StreamKey, StreamRecords
from services.experience.runs.limits import adapter_config
from services.experience.runs.registry import Run, RunRegistry
from services.experience.workers.vision import VisionProcessor

logger = logging.getLogger(__name__)


def statistics_key(run_id: str, run: Run | None, caller: Caller, stream_id: str = "") -> StatisticsKey | None:
    """Whose running statistics a stream advances: a created run's own; for a ``run_id`` no run was created for,
    that id scoped to ``caller`` (another token's streams of the id never touch them); without ``run_id``, a
    resumable stream's own (kept across its opens, scoped to ``caller``), else None (the stream's, in memory)."""
    if not run_id:
        return StatisticsKey(stream_id, StreamKey(caller.principal, stream_id).statistics_scope) if stream_id else None
    return StatisticsKey(run_id) if run is not None else StatisticsKey(run_id, caller.principal)


def tenant_key(run_id: str, run: Run | None, caller: Caller, request_id: str) -> str:
    """Whose fair share a stream draws on (``ExperienceRequest.tenant``): a created run's (``run:<id>``); a
    ``run_id`` no run was created for, or without one the request, scoped to ``caller`` as statistics are
    (``run:<id>@<principal>``, ``request:<request_id>@<principal>``): no id a caller picks joins another's share."""
    if run is not None:
        return run_tenant(run_id)
    return f"{run_tenant(run_id)}@{caller.principal}" if run_id else f"request:{request_id}@{caller.principal}"


async def _until_drained(experiences: AsyncIterator[Any], drained: asyncio.Event) -> AsyncIterator[Any]:
    """``experiences`` until ``drained`` is set: then the step in progress is cancelled (the pipeline closes its
    generations) and NotReady says to resume elsewhere."""
    drain = asyncio.ensure_future(drained.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(experiences))
            await asyncio.wait({step, drain}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise NotReady("MakeExperiences: this experience replica is stopping (drained): resume the stream "
                               "(stream_id) on another replica")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        drain.cancel()
        if step is not None and not step.done():  # drained, or the call cancelled: the pipeline's step ends first
            step.cancel()
            cancelled = False
            while not step.done():  # (its generator is closed next: it must not be running then)
                try:
                    await asyncio.wait({step})
                except asyncio.CancelledError:  # cancelled again meanwhile: still wait, then say so
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError


def _count(experience: Any, run: Run | None, resumed: bool) -> None:
    """A delivered batch in the run's and the resumes' metrics."""
    tokens = int(experience.response_length.sum())
    if run is not None:
        metrics.RUN_SAMPLES.labels(run.run_id).inc(len(experience.reward))
        metrics.RUN_TOKENS.labels(run.run_id).inc(tokens)
    if resumed:
        metrics.RESUMED_TOKENS.inc(tokens)


def _trailers(decoded: ExperienceRequest, stats: StreamStats, drained: bool) -> tuple[tuple[str, str], ...]:
    """A stream's trailing metadata: its counters, the groups it failed or did not deliver, whether it drained."""
    trailers = [
        ("fastexp-dropped-groups", str(stats.dropped_groups)),
        ("fastexp-generation-rounds", str(stats.generation_rounds)),
        ("fastexp-resampled-groups", str(stats.resampled_groups)),
        ("fastexp-rerouted-groups", str(stats.rerouted_groups)),
        ("fastexp-failed-groups", str(len(stats.failed_groups))),
        ("fastexp-truncated-prompts", str(len(decoded.truncated_prompt_indices))),
        ("fastexp-skipped-prompts", str(len(decoded.skipped_prompt_indices))),
    ]
    if stats.failed_groups:
        trailers.append((FAILED_KEY, ",".join(map(str, sorted(stats.failed_groups)))))
    if stats.undelivered_prompt_indices is not None:
        trailers.append((UNDELIVERED_KEY, ",".join(map(str, stats.undelivered_prompt_indices))))
    if drained:
        trailers.append((DRAINED_KEY, "true"))
    return tuple(trailers)


class Readiness(Protocol):
    """What the generator serves, while the service is ready (:class:`~services.experience.fleet.readiness.UpstreamMonitor`)."""

    def require_ready(self) -> GeneratorInfo:
        """At once; raises NotReady (UNAVAILABLE, naming what the service waits for) while not ready."""
        ...

    async def ready_info(self, wait_s: float) -> GeneratorInfo:
        """Within ``wait_s`` seconds of readiness; raises NotReady as :meth:`require_ready` after that."""
        ...

    @property
    def generator_info(self) -> GeneratorInfo | None:
        """The generator fleet's last model info (None before it was first reached)."""
        ...


class ExperienceServicer(RunMethods, experience_pb2_grpc.ExperienceServiceServicer):
    """``fastexp.v1.ExperienceService`` over an :class:`ExperienceMaker` and the service's ``runs``
    (:class:`RunRegistry`; the run RPCs are :class:`RunMethods`).

    A stream or weight update that arrives while the service is NOT_SERVING (``readiness``) waits up to
    ``ready_wait_s`` (half its deadline at most) for it, then is refused UNAVAILABLE naming what the service waits
    for: a replica is NOT_SERVING for the moment it follows an update made through another replica, and the
    trainer that made it opens its next stream right away, on whichever replica its channel reaches.
    """

    def __init__(
        self,
        maker: ExperienceMaker,
        tokenizer: Any,
        limits: RequestLimits,
        readiness: Readiness,
        runs: RunRegistry,
        weights_staging_dir: str | None = None,
        max_concurrent_streams: int = 64,
        vision: VisionProcessor | None = None,
        media_limits: MediaLimits | None = None,
        checkpoint_roots: tuple[Path, ...] = (),
        *,
        streams: StreamRecords,
        drain_margin_s: float = 5.0,
        ready_wait_s: float = 10.0,
        policy_dtype: str = "",
    ) -> None:
        self._maker = maker
        self._stream_records = streams
        self._drained = asyncio.Event()  # set when this replica stops: open streams end for their clients to resume
        self._drain_margin_s = drain_margin_s
        self._runs = runs
        self._update_bounds = UpdateBounds(lambda target: self._maker.update_spec(target), checkpoint_roots)
        self._vision = vision
        self._media_limits = media_limits or MediaLimits()
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode-request")
        self._max_concurrent_streams = max_concurrent_streams
        self._streams = 0
        self._tokenizer = tokenizer
        self._limits = limits
        self._readiness = readiness
        self._policy_dtype = policy_dtype  # the actor replica's ("bfloat16", ...), agreed with the fleet's
        self._ready_wait_s = ready_wait_s
        self._weights_staging_dir = weights_staging_dir
        # weight updates in progress (each LoRA run's id, "" for the base model) and deleted LoRA runs whose
        # adapter is being freed: one at a time per key
        self._updating: set[str] = set()

    async def MakeExperiences(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.MakeExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[experience_pb2.ExperienceBatch]:
        if self._streams >= self._max_concurrent_streams:
            raise Overloaded(f"max_concurrent_streams: {self._streams} streams are being served; retry later")
        # a created run's slot (its owner's, within its max_streams on every replica: the state store's); a
        # run_id no run was created for names running statistics only, the caller's own
        self._streams += 1  # counted before the first await: streams arriving together cannot all pass the check
        try:
            check_stream_fields(request)  # before its slot: a resume takes over its earlier opens' slots
            async with self._runs.streaming(request.run_id, current_caller(), request.stream_id,
                                            resume=request.HasField("resume")) as run:
                async for batch in self._stream(request, context, run):
                    yield batch
        finally:
            self._streams -= 1

    async def _stream(
        self, request: experience_pb2.MakeExperiencesRequest, context: grpc.aio.ServicerContext, run: Run | None
    ) -> AsyncIterator[experience_pb2.ExperienceBatch]:
        """One admitted stream: decode (within ``run``'s limits), open its record (a resumable stream), run the
        pipeline, encode each batch until this replica drains; trailers however it ends."""
        self._maker.require_models_loaded("MakeExperiences")
        await self._maker.catch_up()  # the live versions made through other replicas (NotReady: the store)
        decoded = await self._decode(request, context, run)
        if request.stream_id:  # the stream's record: v0, what was counted; a resume leaves out what the client holds
            decoded, open_number = await self._open_stream(request, decoded)
            # taken up: from here the client resumes a break (a refusal before is the request's answer)
            await context.send_initial_metadata(((STREAM_OPEN_KEY, str(open_number)),))
        bind_request_id(decoded.request_id)  # its logs here, and its calls to the generator and scorer
        deadline = Deadline.from_remaining(context.time_remaining())
        stats = StreamStats()
        drained = False
        try:
            key = statistics_key(request.run_id, run, current_caller(), request.stream_id)
            async with (contextlib.aclosing(self._maker.make_experiences(decoded, deadline, stats, key)) as experiences,
                        contextlib.aclosing(_until_drained(experiences, self._drained)) as batches):
                async for experience in batches:
                    _count(experience, run, resumed=request.HasField("resume"))
                    yield experience_to_pb(experience)
        except NotReady:
            drained = self._drained.is_set()
            metrics.STREAMS_DRAINED.inc(drained)
            raise
        finally:
            context.set_trailing_metadata(_trailers(decoded, stats, drained))

    async def _decode(self, request: experience_pb2.MakeExperiencesRequest, context: grpc.aio.ServicerContext,
                      run: Run | None) -> ExperienceRequest:
        """The validated request, within ``run``'s limits and with its share weight, window and adapter."""
        limits = self._limits if run is None else dataclasses.replace(
            self._limits, max_tokens_per_request=run.limits.max_tokens_per_request)
        info = await self._ready(context)  # NotReady (UNAVAILABLE) naming what the service waits for
        try:
            # images are decoded and patchified here: off the event loop, one request at a time (the tokenizer
            # and processor are not safe to share between threads)
            decoded = await asyncio.get_running_loop().run_in_executor(self._decoder, functools.partial(
                decode_request, request, self._tokenizer, limits, info.max_model_len,
                has_critic=self._maker.has_critic, vision=self._vision, media_limits=self._media_limits,
            ))
        except InvalidPrompts as error:
            context.set_trailing_metadata(((INVALID_PROMPTS_KEY, ",".join(map(str, error.prompt_indices))),))
            raise
        if decoded.config.episodes is not None and not self._maker.runs_episodes:
            raise InvalidRequest("environment", "this experience service runs no multi-turn episodes")
        if decoded.config.agent is not None:
            self._maker.check_agent(decoded.config.agent.name)  # INVALID_ARGUMENT: not one of the operator's
        if not request.request_id and current_request_id():  # the trainer's x-request-id names the stream
            decoded = dataclasses.replace(decoded, request_id=current_request_id())
        decoded = dataclasses.replace(decoded, tenant=tenant_key(request.run_id, run, current_caller(), decoded.request_id))
        if run is not None:  # the run's record: its weight in the generator's fair share, its window, its adapter
            decoded = dataclasses.replace(decoded, run=RunBinding(
                run.run_id, float(run.limits.weight), run.limits.max_groups_ahead,
                None if run.lora is None else run.run_id))
            check_lora_stream(decoded.config, run, self._maker.adapter_version(run.run_id))
        return decoded

    async def _open_stream(self, request: experience_pb2.MakeExperiencesRequest,
                           decoded: ExperienceRequest) -> tuple[ExperienceRequest, int]:
        """Open (or resume) the stream's record in the store; returns the request (a resume's without the groups
        it holds) and this open's number (1, 2, ...)."""
        principal = current_caller().principal
        version = self._maker.clocks.of(decoded.adapter).version
        record = await self._stream_records.open(StreamKey(principal, request.stream_id), request_fingerprint(request),
                                                 version, request.resume.delivered_prompt_indices,
                                                 resume=request.HasField("resume"))
        point = StreamPoint(request.stream_id, principal, record.start_version, request.resume.next_batch_index,
                            record.opens)
        if not request.HasField("resume"):
            return dataclasses.replace(decoded, stream=point), record.opens
        resumed = resumed_request(decoded, request.resume, point)
        metrics.STREAMS_RESUMED.inc()
        metrics.GROUPS_REGENERATED.inc(len(resumed.prompts))
        logger.info("%s: stream %s resumed (open %d): %d groups held, %d to generate", decoded.request_id,
                    request.stream_id, record.opens, len(decoded.prompts) - len(resumed.prompts), len(resumed.prompts))
        return resumed, record.opens

    def drain(self, grace_s: float) -> None:
        """This replica stops (SIGTERM): open streams run on for ``grace_s`` less the drain margin, then end with
        UNAVAILABLE (``fastexp-drained``) for their clients to resume elsewhere; new streams are refused by the
        server meanwhile."""
        after = max(0.0, grace_s - self._drain_margin_s)
        logger.info("draining: %d open streams get %.1f s to finish, then are handed over", self._streams, after)
        asyncio.get_running_loop().call_later(after, self._drained.set)

    async def UpdateWeights(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[generation_pb2.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> generation_pb2.UpdateWeightsResponse:
        async with lingering(request_iterator):  # a refusal's status reaches a client still sending
            return await self._update_weights(request_iterator, context)

    async def _update_weights(
        self, request_iterator: AsyncIterator[generation_pb2.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> generation_pb2.UpdateWeightsResponse:
        run_id = dict(context.invocation_metadata() or ()).get(RUN_ID_KEY)
        # its owner or an admin token, and an admin token for a base-model run's (shared) weights
        run = await self._runs.authorize_update(run_id, current_caller()) if run_id else None
        await self._ready(context)  # NotReady: the update could not reach the generator
        key = run.run_id if run is not None and run.lora is not None else ""  # each LoRA run's, and the base's
        if key in self._updating:
            raise Overloaded(f"run_id: another update of run {key!r}'s adapter, or the deletion of a previous run "
                             "of that id, is in progress" if key else "another weight update is in progress")
        self._updating.add(key)
        deadline = Deadline.from_remaining(context.time_remaining())
        try:  # once received, an update is applied whole (or fails whole) even if its caller goes meanwhile
            if run is not None and run.lora is not None:
                config = adapter_config(run.lora)
                bounds = UpdateBounds(functools.partial(self._adapter_spec, config))
                async with staged_update(request_iterator, self._weights_staging_dir, bounds=bounds, hash_data=True,
                                         in_memory=True) as update:  # in memory, its blob's digest as it arrives
                    version = await run_to_end(self._maker.update_adapter(run.run_id, config, update, deadline),
                                               f"run {run.run_id}'s adapter update")
            else:
                async with staged_update(request_iterator, self._weights_staging_dir, bounds=self._update_bounds) as update:
                    await run_to_end(self._maker.update_weights(update, deadline), "a weight update")
                version = self._maker.policy.version
        finally:
            self._updating.discard(key)
        return generation_pb2.UpdateWeightsResponse(
            policy_version=version, critic_version=self._maker.critic_version,
            num_tensors=len(update.entries), num_bytes=update.num_bytes,
        )

    async def _ready(self, context: grpc.aio.ServicerContext) -> GeneratorInfo:
        """What the generator serves, waiting while NOT_SERVING (class docs); NotReady after the wait."""
        remaining = context.time_remaining()
        wait_s = self._ready_wait_s if remaining is None else min(self._ready_wait_s, remaining / 2)
        return await self._readiness.ready_info(wait_s)

    def _adapter_spec(self, config: AdapterConfig, target: str) -> dict[str, TensorSpec]:
        """What a LoRA run's update is checked against: its adapter's tensors (the policy's, never the critic's).

        Raises:
            InvalidRequest: ``header.target`` is not the policy.
        """
        if target != "policy":
            raise InvalidRequest("header.target", "a LoRA run's update carries its adapter: target the policy")
        return self._maker.adapter_spec(config)

    async def GetServerInfo(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.ServerInfo:
        info = self._readiness.generator_info  # None before the fleet was reached: no type said yet
        generator_dtype = info.dtype if info is not None else ""
        return experience_pb2.ServerInfo(features=[TENSOR_BATCHES],
                                         policy_dtype=agreed_dtype(self._policy_dtype, generator_dtype))

    async def OffloadModels(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.OffloadModelsRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.ModelPlacementResponse:
        if self._streams:
            raise FailedPrecondition(f"OffloadModels: {self._streams} MakeExperiences streams open; offload once "
                                     "they end")
        moved, names = await self._maker.offload_models()
        return experience_pb2.ModelPlacementResponse(moved_bytes=moved, models=names)

    def _policy_version(self, run: Run) -> int:
        return self._maker.policy.version if run.lora is None else run.live.version  # the run's own record

    def _served_lora_rank(self) -> int:
        if not self._maker.serves_adapters:
            return 0
        return min(self._readiness.require_ready().max_lora_rank, self._runs.limits.max_lora_rank)  # NotReady

    async def _run_deleted(self, run: Run) -> None:
        if run.lora is not None:
            await self._maker.remove_adapter(run.run_id)

    def _share_usage(self, run_id: str) -> tuple[int, int]:
        return self._maker.share_usage(run_tenant(run_id))

    async def ReloadModels(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.ReloadModelsRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.ModelPlacementResponse:
        moved, names = await self._maker.reload_models()
        return experience_pb2.ModelPlacementResponse(moved_bytes=moved, models=names)

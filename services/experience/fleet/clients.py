"""gRPC adapters the experience pipeline calls: the generator and the scorer.

Each call carries a deadline (``Deadline.timeout``); every channel goes through the one client interceptor
(:class:`fastexp.channels.ClientEdge`: bearer token, the bound request id), and gRPC failures become domain errors
naming the service by the one status table (:mod:`fastexp.status`: UNAVAILABLE -> NotReady, DEADLINE_EXCEEDED ->
UpstreamTimeout, RESOURCE_EXHAUSTED -> Overloaded, a peer's INVALID_ARGUMENT -> InvalidRequest, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping

import grpc
import stamina
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastexp.status import attributed_error
from fastexp.tensor_codec import to_numpy, to_torch
from fastexp.v1 import (
    environment_pb2,
    environment_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    scoring_pb2,
    scoring_pb2_grpc,
)
from fastexp.weights import TENSOR_BATCHES, weight_chunks
from fastexp.wire import sampling_to_pb
from services.common.deadlines import Deadline
from services.common.errors import EpisodeFailed, FastexpError, NotReady, RewardFailed, UpstreamTimeout
from services.common.generation import CPU_THREADS, CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig
from services.common.media_wire import media_to_pb
from services.common.weights import ReceivedUpdate
from services.common.weights.wire import adapter_chunks, entry_chunks
from services.experience.fleet.readiness import GeneratorInfo
from services.experience.pipeline.events import EpisodeStep, ScoreBatch, Scores

SCORER_SERVICE = scoring_pb2.DESCRIPTOR.services_by_name["ScoringService"].full_name

_FINISH = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


def translate_rpc_error(service: str, error: grpc.aio.AioRpcError) -> FastexpError:
    """The domain error for a failed call to ``service``, named in its message (the status table's inverse:
    :func:`fastexp.status.attributed_error`)."""
    return attributed_error(service, error)


class GeneratorClient:
    """Calls one ``GenerationService`` (a replica of :class:`~services.experience.fleet.generator_fleet.GeneratorFleet`; alone, it
    implements :class:`services.experience.pipeline.events.Generator` too)."""

    def __init__(
        self, channel: grpc.aio.Channel, timeout_s: float, update_timeout_s: float = 600.0, address: str | None = None
    ) -> None:
        self._service = f"generator {address}" if address else "generator"  # what its errors are prefixed with
        self._channel = channel
        self._stub = generation_pb2_grpc.GenerationServiceStub(channel)
        self._timeout_s = timeout_s
        self._update_timeout_s = update_timeout_s
        #: Whether the generator takes several small tensors per message (its ModelInfo lists TENSOR_BATCHES; read
        #: on each :meth:`model_info`, which the fleet's probes call before any update reaches a replica)
        self._batches = False

    async def close(self) -> None:
        """Close the channel (calls in flight are cancelled)."""
        await self._channel.close()

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline, version: int | None = None) -> int:
        """Forward a received policy update (its staged tensors read from disk one at a time, each with its CRC-32,
        or the checkpoint folder's name), live there as ``version`` (``None``: the generator's previous + 1);
        returns the generator's policy version once the update is live there.

        Raises:
            InvalidRequest: the generator rejected it (nothing was applied); NotReady, UpstreamTimeout, Overloaded.
        """
        return await self._send(entry_chunks(update, policy_version=version, batch=self._batches), deadline)

    async def load_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], num_tensors: int, version: int, deadline: Deadline
    ) -> int:
        """Send named policy tensors (e.g. the actor replica's, to a replica that restarted), live as ``version``;
        returns the generator's policy version once live. Raises as :meth:`update_weights`."""
        chunks = weight_chunks(tensors, num_tensors=num_tensors, policy_version=version, batch=self._batches)
        return await self._send(chunks, deadline)

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int, deadline: Deadline,
        *, weights_digest: str = "",
    ) -> int:
        """Load LoRA adapter ``name`` (peft-named tensors, held in the generator's memory: no disk), live there as
        ``version``, named ``weights_digest`` (its blob's; reported back in ``ModelInfo``); returns the adapter's
        version once live.

        Raises:
            InvalidRequest: the generator rejected it (naming the field or tensor; its previous version serves on).
            FailedPrecondition: the generator takes no adapters, or sleeps. NotReady, UpstreamTimeout.
        """
        chunks = adapter_chunks(name, config, tensors, version=version, weights_digest=weights_digest,
                                batch=self._batches)

        async def messages() -> AsyncIterator[generation_pb2.AdapterChunk]:
            while (message := await asyncio.to_thread(next, chunks, None)) is not None:
                yield message

        try:
            response = await self._stub.LoadAdapter(messages(), timeout=deadline.timeout(self._update_timeout_s))
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        return response.version

    async def unload_adapter(self, name: str, deadline: Deadline | None = None) -> bool:
        """Free LoRA adapter ``name`` there (requests already sampling with it finish on it) within ``deadline``
        (None: the update timeout); False when it held none of that name (a retried unload, a replica that
        restarted: not an error).

        Raises:
            InvalidRequest: a malformed name.
            FailedPrecondition: the generator takes no adapters.
            NotReady: the generator is unreachable.
            UpstreamTimeout: no answer within the deadline.
        """
        try:
            response = await self._stub.UnloadAdapter(generation_pb2.UnloadAdapterRequest(name=name),
                                                      timeout=(deadline or Deadline()).timeout(self._update_timeout_s))
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        return response.unloaded

    async def _send(self, chunks: Iterator[generation_pb2.WeightsChunk], deadline: Deadline) -> int:
        """Stream ``chunks`` (produced off the event loop: they read tensors) as one ``UpdateWeights`` call."""

        async def messages() -> AsyncIterator[generation_pb2.WeightsChunk]:
            while (message := await asyncio.to_thread(next, chunks, None)) is not None:
                yield message

        try:
            response = await self._stub.UpdateWeights(
                messages(), timeout=deadline.timeout(self._update_timeout_s)
            )
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        return response.policy_version

    async def model_info(self, timeout_s: float) -> GeneratorInfo:
        """The generator's model info; fails fast when it cannot be reached (the caller retries).

        Raises:
            NotReady: the generator is unreachable (not started yet, restarting, gone).
            UpstreamTimeout: it did not answer within ``timeout_s``.
        """
        try:
            info = await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        self._batches = TENSOR_BATCHES in info.features
        return GeneratorInfo(
            model_name=info.model_name, backend=info.backend, max_model_len=info.max_model_len,
            policy_version=info.policy_version, multimodal=info.multimodal, max_lora_rank=info.max_lora_rank,
            adapters={adapter.name: adapter.version for adapter in info.adapters},
            adapter_digests={adapter.name: adapter.weights_digest for adapter in info.adapters},
            max_cpu_threads=info.max_cpu_threads if CPU_THREADS in info.features else 0, dtype=info.dtype,
        )

    async def set_cpu_threads(self, threads: int, timeout_s: float) -> int:
        """Run the generator's CPU engine on ``threads`` of its bound cores (0: all) from its next step; returns
        the threads it runs on.

        Raises:
            FailedPrecondition: the engine's threads are not adjustable. NotReady, UpstreamTimeout: as
                :meth:`model_info`.
        """
        request = generation_pb2.SetCpuThreadsRequest(threads=threads)
        try:
            response = await self._stub.SetCpuThreads(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        return response.threads

    async def generate(self, request: GenerationRequest, deadline: Deadline) -> AsyncIterator[CompletionRecord]:
        message = generation_pb2.GenerateRequest(
            request_id=request.request_id,
            prompts=[
                generation_pb2.GenerationPrompt(token_ids=generation_pb2.TokenIds(ids=p), media=media_to_pb(request.media_of(i)))
                for i, p in enumerate(request.prompts)
            ],
            sampling=sampling_to_pb(request.sampling),
            n_samples_per_prompt=request.n_samples_per_prompt,
            adapter=request.adapter or "",
        )
        call = self._stub.Generate(message, timeout=deadline.timeout(self._timeout_s))
        try:
            async for response in call:
                for c in response.completions:
                    yield CompletionRecord(
                        prompt_index=c.prompt_index,
                        sample_index=c.sample_index,
                        prompt_token_ids=tuple(c.prompt_token_ids),
                        output_token_ids=tuple(c.output_token_ids),
                        output_log_probs=to_numpy(c.output_log_probs),
                        finish_reason=_FINISH.get(c.finish_reason, "length"),
                        text=c.text,
                        policy_version=c.policy_version,
                    )
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error(self._service, error) from error
        finally:
            call.cancel()


class ScorerClient:
    """Calls ``ScoringService`` (implements :class:`services.experience.pipeline.maker.Scorer`).

    Reward teams restart and replace scorer containers while training runs, so a Score call that finds the scorer
    gone (UNAVAILABLE) is retried with capped exponential backoff and jitter (stamina) until ``timeout_s`` or the
    request's deadline, whichever comes first. Scoring is a pure function of the texts, so a retried call cannot
    score a group twice: the pipeline keeps exactly one answer per group. Other errors are not retried.
    """

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, retry_wait_max_s: float = 2.0) -> None:
        self._stub = scoring_pb2_grpc.ScoringServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._timeout_s = timeout_s
        self._retry_wait_max_s = retry_wait_max_s

    async def score(self, batch: ScoreBatch, deadline: Deadline) -> Scores:
        """Rewards and metrics for ``batch``'s queries; UNAVAILABLE is retried within the budget (see the class).

        Raises:
            NotReady: the scorer stayed unavailable for the whole budget.
            RewardFailed: the scorer answered, but some responses have no reward (its errors are in the message).
            UpstreamTimeout, InvalidRequest, Overloaded: from the scorer, not retried.
        """
        message = scoring_pb2.ScoreRequest(
            queries=batch.queries, prompts=batch.prompts, labels=batch.labels, references=batch.references,
            media=[media_to_pb(m) for m in batch.media],
        )
        budget_s = deadline.timeout(self._timeout_s)
        retries = stamina.retry_context(
            on=NotReady, attempts=None, timeout=budget_s, wait_initial=0.1, wait_max=self._retry_wait_max_s
        )
        async for attempt in retries:
            with attempt:
                response = await self._score_once(message, deadline)
        failures = [error for error in response.errors if error]
        if failures:
            distinct = list(dict.fromkeys(failures))
            raise RewardFailed(
                f"scorer: {len(failures)} of {len(batch.queries)} responses have no reward: " + " | ".join(distinct[:3])
            )
        return Scores(
            rewards=to_torch(response.rewards),
            metrics={name: to_torch(values) for name, values in response.metrics.items()},
        )

    async def check_serving(self, timeout_s: float) -> None:
        """Return if the scorer reports SERVING over gRPC health (its sources have started).

        Raises:
            NotReady: unreachable, or NOT_SERVING. UpstreamTimeout: no answer within ``timeout_s``.
        """
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=SCORER_SERVICE), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error("scorer", error) from error
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise NotReady(f"scorer: {status} (its reward sources are starting)")

    async def _score_once(self, message: scoring_pb2.ScoreRequest, deadline: Deadline) -> scoring_pb2.ScoreResponse:
        try:
            return await self._stub.Score(
                message, timeout=deadline.timeout(self._timeout_s), wait_for_ready=True
            )
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error("scorer", error) from error


class EnvironmentClient:
    """Calls ``EnvironmentService`` (hosted by the scorer) for multi-turn episodes; every call has a deadline.

    Errors: ABORTED -> EpisodeFailed (that episode is lost: the environment failed, or its session is gone);
    INVALID_ARGUMENT -> InvalidRequest (an unknown environment). Starting an episode rides out a scorer swap
    (UNAVAILABLE is retried with backoff within ``timeout_s``, as :class:`ScorerClient` does); a step that finds
    the scorer gone fails its episode (EpisodeFailed): the session lived in the process that went away.
    """

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, retry_wait_max_s: float = 2.0) -> None:
        self._stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
        self._timeout_s = timeout_s
        self._retry_wait_max_s = retry_wait_max_s

    async def start(
        self, environment: str, prompt: str, reference: str, label: str, max_turns: int, deadline: Deadline,
        tenant: str = "",
    ) -> tuple[str, str | None, str]:
        """Open an episode for ``tenant`` (its request's fair-share key, ``episodes.tenant_of``: its tool calls' share
        of the scorer's sandbox); returns (session id, first observation or None, its role).

        Raises:
            InvalidRequest: no such environment.
            NotReady: the scorer stayed unreachable for ``timeout_s``.
            EpisodeFailed: the scorer answered ABORTED (the environment failed to start the episode).
            Overloaded: the scorer answered RESOURCE_EXHAUSTED (``max_episodes`` are open).
            UpstreamTimeout: the call's deadline passed.
        """
        message = environment_pb2.StartEpisodeRequest(
            environment=environment, prompt=prompt, reference=reference, label=label, max_turns=max_turns,
            tenant=tenant,
        )
        retries = stamina.retry_context(on=NotReady, attempts=None, timeout=deadline.timeout(self._timeout_s),
                                        wait_initial=0.1, wait_max=self._retry_wait_max_s)
        async for attempt in retries:
            with attempt:
                response = await self._call(self._stub.StartEpisode, message, deadline)
        observation = response.observation if response.HasField("observation") else None
        return response.session_id, observation, response.observation_role or "user"

    async def step(self, session_id: str, action: str, deadline: Deadline) -> EpisodeStep:
        """The environment's answer to one model turn.

        Raises:
            EpisodeFailed: the environment failed, the session is gone, the scorer is unreachable mid-episode, or
                no answer within ``timeout_s``.
            UpstreamTimeout: the request's deadline passed.
        """
        try:
            response = await self._call(
                self._stub.Step, environment_pb2.StepRequest(session_id=session_id, action=action), deadline
            )
        except NotReady as error:
            raise EpisodeFailed(f"the environment service went away mid-episode ({error})") from error
        except UpstreamTimeout as error:
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise  # the request's own deadline: the stream ends
            raise EpisodeFailed(f"the environment did not answer a step in time ({error})") from error
        return EpisodeStep(
            observation=response.observation if response.HasField("observation") else None,
            role=response.observation_role or "user",
            reward=response.reward if response.HasField("reward") else None,
            done=response.done, metrics=dict(response.metrics),
        )

    async def end(self, session_id: str) -> None:
        """Close an episode abandoned before done (best effort: a gone scorer has forgotten it anyway)."""
        with contextlib.suppress(FastexpError):
            await self._call(self._stub.EndEpisode, environment_pb2.EndEpisodeRequest(session_id=session_id),
                             Deadline.from_remaining(5.0))

    async def _call(self, method, message, deadline: Deadline):
        try:
            return await method(message, timeout=deadline.timeout(self._timeout_s))
        except grpc.aio.AioRpcError as error:
            raise translate_rpc_error("environment", error) from error

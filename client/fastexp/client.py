"""The trainer SDK's client: stream Experiences (torch tensors, the seed's field names) from the experience service.

Example::

    from fastexp import ExperienceClient, RequestOptions

    options = RequestOptions(n_samples_per_prompt=4, advantage_estimator="rloo")
    with ExperienceClient("127.0.0.1:50053") as client:
        for exp in client.make_experiences([[{"role": "user", "content": "What is 2 + 3?"}]], options, references=["5"]):
            loss = -(exp.advantages * ratio(exp)).sum() / exp.action_mask.sum()  # exp.action_log_probs, ...

Multimodal prompts (a vision-language policy) give each prompt its images and/or videos::

    client.make_experiences(
        [[{"role": "user", "content": "What is in this picture?"}], "Plain text prompt"],
        images=[["photo.jpg"], []],  # per prompt: file paths, encoded bytes or PIL images
        n_samples_per_prompt=4,
    )

Errors arrive as the domain error of the service's status code (:mod:`fastexp.status`: INVALID_ARGUMENT ->
:class:`fastexp.errors.InvalidRequest`, naming the field; UNAVAILABLE -> ``NotReady``; ...), each also a
``grpc.RpcError`` with ``code()``, ``details()`` and ``trailing_metadata()``; when prompts are the cause,
:func:`invalid_prompt_indices` lists every invalid one.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import stamina
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastexp.channels import client_channel, keepalive_options, message_options
from fastexp.critic import save_value_model
from fastexp.errors import NotReady, Overloaded
from fastexp.packing import unpack_experience
from fastexp.request import (
    DEFAULT_SAMPLING,
    AgentOptions,
    PromptLike,
    RequestOptions,
    Sampling,
    build_request,
    encode_image,
)
from fastexp.resume import (
    DEFAULT_STREAM_RETRY,
    StreamProgress,
    StreamResumesExhausted,
    StreamRetry,
    breaks_stream,
    resumable,
)
from fastexp.runs import Run, RunLimits, create_run_request, run_from_pb
from fastexp.security import ClientTLS
from fastexp.status import (
    FAILED_KEY,
    INVALID_PROMPTS_KEY,
    PER_REQUEST_COUNTERS,
    RUN_ID_KEY,
    UNDELIVERED_KEY,
    indices_in,
    stream_counters,
)
from fastexp.types import Experience, Target
from fastexp.v1 import experience_pb2, experience_pb2_grpc, generation_pb2, generation_pb2_grpc
from fastexp.weights import TENSOR_BATCHES, ServerInfo, server_info, weight_chunks
from fastexp.wire import experience_from_pb

SERVICE_NAME = experience_pb2.DESCRIPTOR.services_by_name["ExperienceService"].full_name

__all__ = [
    "AgentOptions", "DEFAULT_SAMPLING", "Experience", "ExperienceClient", "RequestOptions", "Run", "RunLimits", "Sampling",
    "StreamResumesExhausted", "StreamRetry", "build_request", "encode_image", "invalid_prompt_indices",
    "save_value_model", "undelivered_prompt_indices", "unpack_experience", "update_generator_weights", "weight_chunks",
]

class ExperienceClient:
    """A blocking client of ``fastexp.v1.ExperienceService``; use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 3600.0,
        max_message_bytes: int = 256 * 1024 * 1024,
        tls: ClientTLS | None = None,
        token: str | None = None,
        stream_retry: StreamRetry = DEFAULT_STREAM_RETRY,
        keepalive_s: float = 30.0,
    ):
        """``tls``: connect with TLS (``ClientTLS(ca_file, cert_file, key_file)``, mTLS with the last two);
        ``token``: the bearer token the service's operator issued (an admin token for :meth:`update_weights`);
        ``timeout_s``: a stream's deadline, all its resumes included; ``stream_retry``: how often a broken stream
        is resumed (:class:`fastexp.resume.StreamRetry`; ``StreamRetry(max_resumes=0)``: never); ``keepalive_s``:
        the channel's keepalive ping interval (a replica that vanished without closing the connection fails the
        stream within ~1.5 intervals, and it is resumed: :func:`fastexp.channels.keepalive_options`).

        Raises:
            fastexp.security.SecurityConfigError: a TLS file is missing or empty.
        """
        self._channel = client_channel(address, [*message_options(max_message_bytes), *keepalive_options(keepalive_s)],
                                       tls, token)
        self._stub = experience_pb2_grpc.ExperienceServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._stream_retry = stream_retry
        self._server: ServerInfo | None = None  # GetServerInfo's: features once, the policy type per policy update
        #: ``fastexp-*`` trailing metadata of the last stream as ints, summed over its opens, e.g.
        #: ``dropped-groups``, ``generation-rounds`` (dynamic sampling drops after the last batch are only counted
        #: here), and ``resumes``: how often it was resumed.
        self.last_stream_stats: dict[str, int] = {}
        #: Multi-turn groups the last stream could not deliver (an episode failed in its environment): send again.
        self.last_failed_prompt_indices: list[int] = []

    def make_experiences(
        self, prompts: Sequence[PromptLike], options: RequestOptions | None = None, **columns_and_overrides: Any
    ) -> Iterator[Experience]:
        """Stream Experiences for ``prompts`` with ``options``; keyword arguments are :func:`build_request`'s
        (per-prompt ``references``, ``labels``, ``images``, ``videos``, and any :class:`RequestOptions` field).

        Each yielded Experience holds whole prompt groups; every prompt's group arrives exactly once, also when
        the stream breaks: the stream has a ``stream_id`` (``options.stream_id``, else a new one), and after
        UNAVAILABLE (the replica serving it was killed or drained, the network cut) it is resumed through the same
        address with what was already yielded, within the client's ``stream_retry`` budget
        (:mod:`fastexp.resume`). Stopping the iteration (or ``close``) cancels the stream, which aborts the
        remaining generation. ``run_id=`` a run of :meth:`create_run` streams within that run's limits; any other
        id names running statistics only (this token's own).

        Raises:
            fastexp.resume.StreamResumesExhausted: the stream broke more often than ``stream_retry`` allows (it
                names the prompt groups not delivered; a NotReady, UNAVAILABLE).
            grpc.RpcError: the call failed otherwise (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...; with a created
                run's id: PERMISSION_DENIED when it is another token's, RESOURCE_EXHAUSTED naming max_streams).
        """
        request = build_request(prompts, options, **columns_and_overrides)
        retry = self._stream_retry
        if not request.stream_id and retry.max_resumes > 0:
            request.stream_id = uuid.uuid4().hex
        progress = StreamProgress(len(request.prompts))
        deadline = time.monotonic() + self._timeout_s
        self.last_stream_stats, self.last_failed_prompt_indices = {}, []
        try:
            for attempt in stamina.retry_context(
                on=functools.partial(resumable, request.stream_id, progress), attempts=1 + retry.max_resumes, timeout=None, wait_initial=retry.wait_initial_s,
                wait_max=retry.wait_max_s, wait_jitter=retry.wait_jitter_s,
            ):
                with attempt:
                    yield from self._open_stream(request, progress, deadline)
        except (NotReady, Overloaded) as error:
            if progress.opens <= retry.max_resumes or not request.stream_id or not breaks_stream(progress, error):
                raise
            raise StreamResumesExhausted(request.stream_id, retry.max_resumes, progress.undelivered(), error) from error

    def _open_stream(self, request: experience_pb2.MakeExperiencesRequest, progress: StreamProgress,
                     deadline: float) -> Iterator[Experience]:
        """One open of a stream (the first, or a resume of what ``progress`` lacks); its counters are added to
        :attr:`last_stream_stats` however it ends."""
        if progress.opens:
            request.resume.CopyFrom(progress.resume())
        progress.opens += 1
        stream = self._stub.MakeExperiences(request, timeout=max(0.0, deadline - time.monotonic()))
        trailers = None
        try:
            if request.stream_id:  # the service's headers come as soon as it took the stream up
                progress.open_answered(stream.initial_metadata())
            for message in stream:
                experience = experience_from_pb(message)
                progress.received(experience)  # the trainer's from here: a resume leaves it out
                yield experience
            trailers = stream.trailing_metadata()
            self.last_failed_prompt_indices = indices_in(trailers, FAILED_KEY) or []
        except grpc.RpcError as error:
            trailers = error.trailing_metadata()
            progress.open_answered(error.initial_metadata())
            raise
        finally:
            stream.cancel()
            for name, count in stream_counters(trailers).items():  # each open's own, but for the request's
                summed = self.last_stream_stats.get(name, 0) + count
                self.last_stream_stats[name] = count if name in PER_REQUEST_COUNTERS else summed
            self.last_stream_stats["resumes"] = progress.opens - 1

    def update_weights(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]] = (),
        *,
        target: Target = "policy",
        checkpoint_dir: str | None = None,
        chunk_bytes: int = 4 * 1024 * 1024,
        timeout_s: float = 600.0,
        run_id: str | None = None, in_policy_dtype: bool = True,
    ) -> generation_pb2.UpdateWeightsResponse:
        """Replace the policy's (generator and actor replica) or the critic's weights; returns once they are live.

        Args:
            tensors: ``(name, tensor)`` pairs in checkpoint names, e.g. ``model.state_dict().items()`` or the tensors a
                step changed; in ``chunk_bytes`` pieces (small ones several per message), own float dtype (see below).
            target: ``"policy"`` or ``"critic"`` (names as :func:`save_value_model` writes them).
            checkpoint_dir: instead of tensors, a safetensors folder both services can read (shared storage).
            run_id: the run (:meth:`create_run`) the update is for; only its owner or an admin token may make it.
                A base-model run's weights are the deployment's: updating them needs an admin token, as without
                a run. A LoRA run's update is its whole adapter, ``tensors`` named as peft's
                ``get_peft_model_state_dict(model).items()`` names them
                (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: (rank, in_features);
                ``...lora_B.weight``: (out_features, rank)), every module of the run's ``target_modules``; it is
                loaded on every generator replica and the service's forwards, as the run's next version.
            in_policy_dtype: policy tensors wider than the type the policy is served in (``ServerInfo.policy_dtype``,
                asked before each such update) travel in it where that is bfloat16 or float32 (:func:`narrowed`):
                half the bytes, the same full update served; a LoRA adapter is then held so everywhere.

        Returns:
            The response: ``policy_version`` (every experience sampled after a policy update carries it; a LoRA
            run's: its adapter's version, 1 after the first update), ``critic_version``, ``num_tensors``,
            ``num_bytes``.

        Raises:
            grpc.RpcError: INVALID_ARGUMENT naming a bad tensor (nothing was applied anywhere),
                RESOURCE_EXHAUSTED while another update (of the same LoRA run, or of the base) runs, UNAVAILABLE,
                DEADLINE_EXCEEDED; with ``run_id``: NOT_FOUND, PERMISSION_DENIED naming ``run_id``;
                FAILED_PRECONDITION for a base-model update while LoRA runs exist (it would change their base).
        """
        narrow = in_policy_dtype and target == "policy" and not checkpoint_dir
        if self._server is None or narrow:  # the type now (a redeployed service may serve another)
            self._server = server_info(self._stub, min(timeout_s, 30.0))
        chunks = weight_chunks(tensors, chunk_bytes=chunk_bytes, checkpoint_dir=checkpoint_dir, target=target,
                               batch=TENSOR_BATCHES in self._server.features,
                               wire_dtype=self._server.policy_dtype if narrow else "")
        return self._stub.UpdateWeights(chunks, timeout=timeout_s, metadata=((RUN_ID_KEY, run_id),) if run_id else None)

    def create_run(
        self,
        run_id: str,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
        *,
        max_streams: int = 0,
        max_groups_ahead: int = 0,
        max_tokens_per_request: int = 0,
        weight: int = 0,
        timeout_s: float = 30.0,
    ) -> Run:
        """Create a run owned by this client's token: a LoRA adapter of ``lora_rank`` (``lora_alpha`` None: equal
        to the rank; ``target_modules`` None: every module the operator allows), or the base model itself when
        ``lora_rank`` is None. Its limits (:class:`fastexp.runs.RunLimits`) left 0 take the operator's defaults.

        Raises:
            fastexp.errors.InvalidRequest: ``run_id`` (1..256 of A-Z a-z 0-9 . _ -), ``lora.rank``,
                ``lora.alpha``, ``lora.target_modules`` or ``limits.*`` (named). FailedPrecondition: a LoRA run on
                a deployment that serves no adapters of that rank. AlreadyExists: the id is taken. Overloaded:
                ``max_runs``. ValueError: ``lora_alpha`` or ``target_modules`` without ``lora_rank``.
        """
        limits = RunLimits(max_streams, max_groups_ahead, max_tokens_per_request, weight)
        request = create_run_request(run_id, lora_rank, lora_alpha, target_modules, limits)
        return run_from_pb(self._stub.CreateRun(request, timeout=timeout_s))

    def get_run(self, run_id: str, timeout_s: float = 30.0) -> Run:
        """The run now (live policy version, open streams, limits in force).

        Raises:
            fastexp.errors.NotFound: no such run. PermissionDenied: another token's run (naming ``run_id``).
        """
        return run_from_pb(self._stub.GetRun(experience_pb2.GetRunRequest(run_id=run_id), timeout=timeout_s))

    def list_runs(self, timeout_s: float = 30.0) -> list[Run]:
        """This client's token's runs (every run for an admin token), by run id."""
        return [run_from_pb(r) for r in self._stub.ListRuns(experience_pb2.ListRunsRequest(), timeout=timeout_s).runs]

    def delete_run(self, run_id: str, timeout_s: float = 30.0) -> Run:
        """Delete the run; returns its last state.

        Raises:
            fastexp.errors.NotFound: as :meth:`get_run`.
            fastexp.errors.PermissionDenied: as :meth:`get_run`.
            fastexp.errors.FailedPrecondition: streams of the run are open (delete it once they end).
        """
        return run_from_pb(self._stub.DeleteRun(experience_pb2.DeleteRunRequest(run_id=run_id), timeout=timeout_s))

    def offload_models(self, timeout_s: float = 600.0) -> experience_pb2.ModelPlacementResponse:
        """Move the service's actor, reference and critic to host memory (a trainer sharing the accelerator; the
        seed's ``offload_model``); ``MakeExperiences`` is refused until :meth:`reload_models`.

        Raises:
            grpc.RpcError: FAILED_PRECONDITION (streams open, already offloaded, models already in host memory).
        """
        return self._stub.OffloadModels(experience_pb2.OffloadModelsRequest(), timeout=timeout_s)

    def reload_models(self, timeout_s: float = 600.0) -> experience_pb2.ModelPlacementResponse:
        """Move offloaded models back to their devices. Raises grpc.RpcError FAILED_PRECONDITION when not offloaded."""
        return self._stub.ReloadModels(experience_pb2.ReloadModelsRequest(), timeout=timeout_s)

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the service reports SERVING over gRPC health: it has reached its generator and scorer
        (before that, and while the generator is unreachable, ``MakeExperiences`` answers UNAVAILABLE).

        Raises:
            TimeoutError: not SERVING within ``timeout_s`` (the message has the last health answer).
        """
        health = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                reply = health.Check(request, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            time.sleep(0.25)
        raise TimeoutError(f"the experience service was not SERVING within {timeout_s:.0f} s (last: {last})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ExperienceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def undelivered_prompt_indices(error: grpc.RpcError) -> list[int] | None:
    """The prompt indices a failed ``make_experiences`` stream did not deliver (what to send again), from the
    error's trailing metadata; ``None`` when the service did not say (e.g. the request was rejected outright)."""
    return indices_in(error.trailing_metadata() if hasattr(error, "trailing_metadata") else None, UNDELIVERED_KEY)


def invalid_prompt_indices(error: grpc.RpcError) -> list[int] | None:
    """The indices of every invalid prompt of a request refused with INVALID_ARGUMENT because of its prompts
    (trailing metadata ``fastexp-invalid-prompt-indices``); None when the error says nothing about prompts.
    Nothing of such a request was generated: send it again without these prompts."""
    return indices_in(error.trailing_metadata(), INVALID_PROMPTS_KEY)


def update_generator_weights(
    generator_address: str,
    tensors: Iterable[tuple[str, torch.Tensor]] = (),
    *,
    checkpoint_dir: str | None = None,
    chunk_bytes: int = 4 * 1024 * 1024,
    timeout_s: float = 600.0,
    tls: ClientTLS | None = None,
    token: str | None = None,
) -> int:
    """Send new policy weights straight to a generator (generator-only deployments); returns the new version.

    With an experience service, call :meth:`ExperienceClient.update_weights` instead: it also updates the actor
    replica, so ``action_log_probs`` follow the new policy.

    Args:
        tensors: ``(name, tensor)`` pairs, e.g. ``model.state_dict().items()`` or a subset of it.
        checkpoint_dir: instead of tensors, a safetensors folder the generator can read.
        tls: as :class:`ExperienceClient`.
        token: as :class:`ExperienceClient` (an admin token).

    Raises:
        grpc.RpcError: INVALID_ARGUMENT naming a bad tensor (nothing was applied), RESOURCE_EXHAUSTED while
            another update runs, UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED, PERMISSION_DENIED.
    """
    options = [("grpc.max_send_message_length", chunk_bytes + (1 << 20))]
    with client_channel(generator_address, options, tls, token) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        chunks = weight_chunks(tensors, chunk_bytes=chunk_bytes, checkpoint_dir=checkpoint_dir)
        return stub.UpdateWeights(chunks, timeout=timeout_s).policy_version


def sleep_generator(generator_address: str, level: int = 1, *, timeout_s: float = 600.0,
                    tls: ClientTLS | None = None, token: str | None = None) -> int:
    """Put a generator's engine to sleep (see ``fastexp.v1.SleepRequest``: level 1 keeps the weights in host
    memory, level 2 drops them); returns the bytes it freed.

    Raises:
        grpc.RpcError: FAILED_PRECONDITION (streams open, already asleep, no sleep mode on the platform: the
            message says which), INVALID_ARGUMENT (level).
    """
    with client_channel(generator_address, (), tls, token) as channel:
        response = generation_pb2_grpc.GenerationServiceStub(channel).Sleep(
            generation_pb2.SleepRequest(level=level), timeout=timeout_s)
    return response.freed_bytes


def wake_up_generator(generator_address: str, *, timeout_s: float = 600.0, tls: ClientTLS | None = None,
                      token: str | None = None) -> generation_pb2.WakeUpResponse:
    """Wake a sleeping generator; after level 2 (``needs_weights``) send every tensor with
    :func:`update_generator_weights` (or :meth:`ExperienceClient.update_weights`) before generating.

    Raises:
        grpc.RpcError: FAILED_PRECONDITION (not asleep).
    """
    with client_channel(generator_address, (), tls, token) as channel:
        return generation_pb2_grpc.GenerationServiceStub(channel).WakeUp(
            generation_pb2.WakeUpRequest(), timeout=timeout_s)

"""gRPC adapter of the generator: decode, call the engine, encode. No sampling logic lives here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from fastexp.tensor_codec import from_numpy
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from fastexp.weights import TENSOR_BATCHES
from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidRequest, Overloaded
from services.common.generation import CPU_THREADS, CompletionRecord, GenerationRequest
from services.common.lora import check_name
from services.common.media import MediaLimits, check_pixel_budget, decode_media
from services.common.media_wire import media_from_pb
from services.common.sampling import validate_batch
from services.common.tasks import lingering, run_to_end
from services.common.weights import UpdateBounds, check_complete, check_update, model_spec
from services.common.weights.wire import ReceivedUpdate, staged_update
from services.generator.adapter_wire import ReceivedAdapter, receive_adapter
from services.generator.engine import GenerationEngine
from services.generator.settings import GeneratorSettings

logger = logging.getLogger(__name__)

_FINISH = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def decode_request(
    message: generation_pb2.GenerateRequest, engine: GenerationEngine, settings: GeneratorSettings
) -> GenerationRequest:
    """Validate a ``GenerateRequest`` and tokenize text prompts.

    Raises:
        InvalidRequest: naming the field (``prompts``, ``prompts[3]``, ``sampling.top_p``, ...).
    """
    sampling = validate_batch(
        len(message.prompts), message.n_samples_per_prompt, message.sampling, settings.request_limits()
    )
    limit = engine.description.max_model_len
    vocab_guard = 1 << 31
    prompts, media = [], []
    for i, prompt in enumerate(message.prompts):
        encoded = media_from_pb(prompt.media.images, prompt.media.videos)
        if not encoded.empty and not engine.description.multimodal:
            raise InvalidRequest(f"prompts[{i}].media", "the model is text-only; it takes no images or videos")
        media.append(None if encoded.empty else encoded)
        kind = prompt.WhichOneof("input")
        ids = engine.tokenize(prompt.text) if kind == "text" else list(prompt.token_ids.ids)
        if not ids:
            raise InvalidRequest(f"prompts[{i}]", "prompt is empty")
        if any(t < 0 or t >= vocab_guard for t in ids):
            raise InvalidRequest(f"prompts[{i}].token_ids", "token ids must be non-negative")
        if len(ids) >= limit:
            raise InvalidRequest(f"prompts[{i}]", f"{len(ids)} tokens; the model's limit is {limit}")
        prompts.append(tuple(ids))
    return GenerationRequest(
        request_id=message.request_id or uuid.uuid4().hex,
        prompts=tuple(prompts),
        sampling=sampling,
        n_samples_per_prompt=message.n_samples_per_prompt,
        media=tuple(media) if any(m is not None for m in media) else (),
    )


def decode_request_media(request: GenerationRequest, limits: MediaLimits) -> GenerationRequest:
    """``request`` with its images and videos decoded (blocking: run it off the event loop), once the request's
    pixel budget allows.

    Raises:
        Overloaded: over ``max_request_pixels`` (RESOURCE_EXHAUSTED). InvalidRequest: a bad image or video, named
            (``prompts[3].media.images[1]``).
    """
    if not request.media:
        return request
    check_pixel_budget([m for m in request.media if m is not None], limits.max_request_pixels)
    decoded = tuple(None if m is None else decode_media(m, f"prompts[{i}].media", limits)
                    for i, m in enumerate(request.media))
    return dataclasses.replace(request, decoded_media=decoded)


def encode_completion(record: CompletionRecord) -> generation_pb2.Completion:
    """A ``Completion`` message for one finished sample."""
    return generation_pb2.Completion(
        prompt_index=record.prompt_index,
        sample_index=record.sample_index,
        prompt_token_ids=record.prompt_token_ids,
        output_token_ids=record.output_token_ids,
        output_log_probs=from_numpy(record.output_log_probs),
        finish_reason=_FINISH[record.finish_reason],
        text=record.text,
        policy_version=record.policy_version,
    )


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """``fastexp.v1.GenerationService`` over one engine."""

    def __init__(self, engine: GenerationEngine, settings: GeneratorSettings) -> None:
        self._engine = engine
        self._settings = settings
        self._spec = model_spec(engine.description.model_name)
        self._updating = asyncio.Lock()
        self._tokens = metrics.GENERATED_TOKENS.labels(engine.description.backend)
        self._streams = 0  # Generate streams open (Sleep waits for none)
        self._sleeping = asyncio.Lock()  # one Sleep / WakeUp at a time
        self._loading_adapter = asyncio.Lock()  # one adapter load or unload at a time (receiving runs concurrently)
        self._adapter_digests: dict[str, str] = {}  # each loaded adapter's weights_digest, as its sender named it

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self._engine.sleep_state.require_weights("Generate")
        decoded = decode_request(request, self._engine, self._settings)
        decoded = await asyncio.to_thread(decode_request_media, decoded, self._settings.media_limits())
        unfinished = len(decoded.prompts) * decoded.n_samples_per_prompt
        logger.debug("generate %s: %d prompts x %d samples", decoded.request_id, len(decoded.prompts),
                     decoded.n_samples_per_prompt)
        metrics.GENERATION_REQUESTS_IN_FLIGHT.inc(unfinished)
        self._streams += 1
        try:
            adapter = request.adapter or None
            async with contextlib.aclosing(self._engine.generate(decoded, adapter=adapter)) as records:
                async for record in records:
                    unfinished -= 1
                    metrics.GENERATION_REQUESTS_IN_FLIGHT.dec()
                    self._tokens.inc(len(record.output_token_ids))
                    yield generation_pb2.GenerateResponse(completions=[encode_completion(record)])
        finally:
            self._streams -= 1
            metrics.GENERATION_REQUESTS_IN_FLIGHT.dec(unfinished)  # aborted or failed: the engine dropped them

    async def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        d, threads = self._engine.description, self._engine.cpu_threads
        return generation_pb2.ModelInfo(
            model_name=d.model_name,
            tokenizer=d.tokenizer,
            max_model_len=d.max_model_len,
            policy_version=self._engine.policy_version,
            backend=d.backend,
            eos_token_id=d.eos_token_id,
            pad_token_id=d.pad_token_id,
            multimodal=d.multimodal,
            sleep_level=self._engine.sleep_state.level,
            needs_weights=self._engine.sleep_state.needs_weights,
            max_lora_rank=self._engine.max_lora_rank,
            adapters=[generation_pb2.AdapterVersion(name=name, version=slot.version,
                                                    weights_digest=self._adapter_digests.get(name, ""))
                      for name, slot in sorted(self._engine.adapters.live().items())],
            features=[TENSOR_BATCHES, *([CPU_THREADS] if threads is not None else [])],
            dtype=d.dtype,
            cpu_threads=threads.threads if threads is not None else 0,
            max_cpu_threads=threads.max_threads if threads is not None else 0,
        )

    async def UpdateWeights(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[generation_pb2.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> generation_pb2.UpdateWeightsResponse:
        async with lingering(request_iterator):  # a refusal's status reaches a client still sending
            return await self._update_weights_call(request_iterator)

    async def _update_weights_call(
        self, request_iterator: AsyncIterator[generation_pb2.WeightsChunk]
    ) -> generation_pb2.UpdateWeightsResponse:
        if self._updating.locked():
            raise Overloaded("another weight update is in progress")
        self._engine.sleep_state.require_awake("UpdateWeights")
        async with self._updating:
            bounds = UpdateBounds(self._update_spec, tuple(self._settings.checkpoint_roots))
            async with staged_update(request_iterator, self._settings.weights_staging_dir, bounds=bounds) as update:
                check_update(update.entries, self._spec)
                if self._engine.sleep_state.needs_weights:
                    check_complete(update.entries, self._spec)
                # ends whole before the folder and the lock go, even when the caller has gone
                version = await run_to_end(self._apply_update(update), "a weight update")
        return generation_pb2.UpdateWeightsResponse(
            policy_version=version, num_tensors=len(update.entries), num_bytes=update.num_bytes
        )

    async def _apply_update(self, update: ReceivedUpdate) -> int:
        version = await self._engine.update_weights(update.kind, update.folder, update.policy_version)
        self._engine.sleep_state.needs_weights = False
        return version

    async def _load_adapter(self, received: ReceivedAdapter) -> int:
        version = await self._engine.load_adapter(received.name, received.config, received.tensors, received.version,
                                                  values_checked=True)  # scanned as they arrived
        self._adapter_digests[received.name] = received.weights_digest
        return version

    async def LoadAdapter(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[generation_pb2.AdapterChunk], context: grpc.aio.ServicerContext
    ) -> generation_pb2.LoadAdapterResponse:
        """Receive the adapter into memory, checked as it arrives (:func:`receive_adapter`), and load it; loads
        apply one at a time."""
        async with lingering(request_iterator):  # a refusal's status reaches a client still sending
            return await self._load_adapter_call(request_iterator)

    async def _load_adapter_call(
        self, request_iterator: AsyncIterator[generation_pb2.AdapterChunk]
    ) -> generation_pb2.LoadAdapterResponse:
        self._engine.sleep_state.require_weights("LoadAdapter")
        if not self._engine.max_lora_rank:
            raise FailedPrecondition("LoadAdapter: this generator takes no LoRA adapters (max_loras 0)")
        received = await receive_adapter(request_iterator, self._engine.lora_modules, self._engine.max_lora_rank)
        async with self._loading_adapter:
            # a caller gone leaves no half-kept load
            version = await run_to_end(self._load_adapter(received), f"adapter {received.name}'s load")
        return generation_pb2.LoadAdapterResponse(name=received.name, version=version,
                                                  num_tensors=len(received.tensors), num_bytes=received.num_bytes)

    async def UnloadAdapter(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.UnloadAdapterResponse:
        """Free the adapter (:meth:`~services.generator.engine.GenerationEngine.unload_adapter`), after any load
        in progress; also while asleep. ``unloaded`` false: none of that name was loaded."""
        check_name(request.name, "name")
        if not self._engine.max_lora_rank:
            raise FailedPrecondition("UnloadAdapter: this generator takes no LoRA adapters (max_loras 0)")
        async with self._loading_adapter:
            unloaded = await self._engine.unload_adapter(request.name)
            self._adapter_digests.pop(request.name, None)
        return generation_pb2.UnloadAdapterResponse(name=request.name, unloaded=unloaded)

    async def SetCpuThreads(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.SetCpuThreadsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.SetCpuThreadsResponse:
        """Set a CPU engine's model threads (:class:`~services.generator.cpu_threads.CpuThreads`)."""
        threads = self._engine.cpu_threads
        if threads is None:
            raise FailedPrecondition(f"SetCpuThreads: this {self._engine.description.backend} engine's threads are "
                                     "not adjustable (vLLM on CPU only)")
        applied = await threads.set(request.threads)
        return generation_pb2.SetCpuThreadsResponse(threads=applied, max_cpu_threads=threads.max_threads)

    def _update_spec(self, target: str) -> dict:
        """The served model's tensors, which a policy update is checked against as it arrives.

        Raises:
            InvalidRequest: ``header.target`` is the critic; ``tensors`` when the model has no safetensors files.
        """
        if target != "policy":
            raise InvalidRequest("header.target", "the generator serves the policy only (send critic updates to the "
                                 "experience service)")
        if not self._spec:
            raise InvalidRequest("tensors", "the served model has no safetensors files to check updates against")
        return self._spec

    async def Sleep(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.SleepRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.SleepResponse:
        if request.level not in (1, 2):
            raise InvalidRequest("level", f"must be 1 (weights to host memory) or 2 (weights dropped), got {request.level}")
        async with self._sleeping:
            self._engine.sleep_state.require_awake("Sleep")
            if self._streams or self._updating.locked():
                raise FailedPrecondition(f"Sleep: {self._streams} Generate streams open"
                                         f"{' and a weight update' if self._updating.locked() else ''}; "
                                         "sleep once they end")
            freed = await self._engine.sleep(request.level)
        return generation_pb2.SleepResponse(level=request.level, freed_bytes=freed)

    async def WakeUp(  # noqa: N802 - gRPC method name
        self, request: generation_pb2.WakeUpRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.WakeUpResponse:
        async with self._sleeping:
            if not self._engine.sleep_state.level:
                raise FailedPrecondition("WakeUp: the engine is awake")
            await self._engine.wake_up()
        state = self._engine.sleep_state
        return generation_pb2.WakeUpResponse(policy_version=self._engine.policy_version,
                                             needs_weights=state.needs_weights)

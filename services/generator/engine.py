"""The generator's core: the engine Protocol its backends implement and what an engine serves (the request and
completion records it exchanges with the experience service are in :mod:`services.common.generation`).

Nothing here imports grpc. Backends: :mod:`services.generator.vllm_engine` (vLLM's async engine, continuous
batching) and :mod:`services.generator.hf_engine` (transformers ``generate``, the fallback).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from services.common.errors import FailedPrecondition
from services.common.generation import CompletionRecord, GenerationRequest

if TYPE_CHECKING:
    import torch

    from services.common.lora import AdapterConfig
    from services.generator.adapters import AdapterTable
    from services.generator.cpu_threads import CpuThreads


@dataclass(frozen=True)
class ModelDescription:
    """What an engine serves."""

    model_name: str
    tokenizer: str
    max_model_len: int
    backend: Literal["vllm", "hf"]
    eos_token_id: int
    pad_token_id: int
    multimodal: bool = False  # accepts images/videos (a vision-language model with its processor)
    dtype: str = ""  # the floating-point type the model runs in ("bfloat16", "float32", ...)


@dataclass
class SleepState:
    """Whether an engine sleeps (``level`` 1 or 2, 0 awake) and whether Sleep(level 2) left it without weights
    (``needs_weights``: until an update with every tensor). The servicer gates Generate and UpdateWeights on it."""

    level: int = 0
    needs_weights: bool = False

    def require_awake(self, what: str) -> None:
        """Raises FailedPrecondition naming ``what`` while asleep."""
        if self.level:
            raise FailedPrecondition(f"{what}: the engine is asleep (Sleep level {self.level}); call WakeUp first")

    def require_weights(self, what: str) -> None:
        """Raises FailedPrecondition naming ``what`` while asleep, or awake without weights after level 2."""
        self.require_awake(what)
        if self.needs_weights:
            raise FailedPrecondition(f"{what}: Sleep(level 2) dropped the weights; send an UpdateWeights with every "
                                     "tensor of the model first")


class TokenizerEngine:
    """What both backends share: the policy version counter and tokenizing with the model's tokenizer (no
    special tokens). Subclasses set ``_tokenizer`` and ``_policy_version``."""

    _tokenizer: Any
    _policy_version: int
    sleep_state: SleepState

    @property
    def policy_version(self) -> int:
        """Version of the weights in use: 0 at start, then the last update's (by default previous + 1)."""
        return self._policy_version

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class GenerationEngine(Protocol):
    """An inference engine that samples completions (cf. vLLM's ``EngineClient``)."""

    description: ModelDescription
    max_lora_rank: int  # the highest adapter rank load_adapter takes; 0: none
    lora_modules: Mapping[str, tuple[int, int]]  # the base's linear layers adapters may target: (out, in) features
    adapters: AdapterTable  # each adapter's live version
    cpu_threads: CpuThreads | None  # a CPU engine's model threads, set at run time (None: not adjustable)

    @property
    def policy_version(self) -> int:
        """Version of the weights in use: 0 at start, +1 per weight update."""
        ...

    def generate(self, request: GenerationRequest, adapter: str | None = None) -> AsyncIterator[CompletionRecord]:
        """Yield each of the ``P * n`` completions as soon as it finishes (order unspecified), sampled with the
        LoRA adapter named ``adapter`` (its records carry the adapter's version) or the base model (None).

        Closing or cancelling the iterator aborts the request's unfinished samples.

        Raises:
            InvalidRequest: ``adapter``: no adapter of that name is loaded.
        """
        ...

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int | None = None, *,
        values_checked: bool = False,
    ) -> int:
        """Add LoRA adapter ``name`` over the base model, or replace its weights, from peft-named tensors in memory
        (:mod:`services.generator.adapters`), checked whole before anything is applied (``values_checked``: the
        caller scanned these very tensors for NaN and infinity; not scanned again). Requests started after it
        returns use it. Returns the adapter's version: ``version``, or the previous + 1 (1 for a first load).

        Raises:
            InvalidRequest: a check failed (naming the field or tensor); the previous version keeps serving.
            FailedPrecondition: the engine takes no adapters.
        """
        ...

    async def unload_adapter(self, name: str) -> bool:
        """Free LoRA adapter ``name``: requests started after it returns cannot name it (InvalidRequest) and
        :attr:`adapters` no longer lists it; those sampling with it finish on it (as on a version a load replaced),
        and its weights are dropped after the last (while asleep, vLLM drops them at wake-up). Returns False when
        no adapter of that name was loaded (nothing changes)."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    async def update_weights(self, kind: str, folder: str, version: int | None = None) -> int:
        """Apply the update in ``folder`` (``kind``: "staged" or "checkpoint"; already checked) between steps.

        Samples in flight finish under the old weights and carry the old version; samples started after it
        returns use the new weights. Returns the new policy version: ``version`` (a fleet's experience service
        sets it), or the previous + 1.
        """
        ...

    async def check_health(self) -> None:
        """Return if the engine can serve; raise otherwise."""
        ...

    sleep_state: SleepState

    async def sleep(self, level: int) -> int:
        """Free the engine's memory (level 1: weights to host memory, KV cache dropped; level 2: weights and KV
        cache dropped) while no request runs; returns the bytes freed and sets ``sleep_state.level``.

        Raises:
            FailedPrecondition: the platform or the engine's start options have no sleep mode, or (level 1) the
                weights already live in host memory; the message says which.
        """
        ...

    async def wake_up(self) -> None:
        """Undo :meth:`sleep` (level 2: room for the weights, ``sleep_state.needs_weights`` set)."""
        ...

    async def close(self) -> None:
        """Stop the engine and free its resources."""
        ...

"""The generator's core: the engine Protocol its backends implement, and the records they exchange.

Nothing here imports grpc. Backends: :mod:`services.generator.vllm_engine` (vLLM's async engine, continuous
batching) and :mod:`services.generator.hf_engine` (transformers ``generate``, the fallback).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from fastexp.v1 import media_pb2
from services.common.media import DecodedMedia
from services.common.sampling import SamplingOptions

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerationRequest:
    """P tokenized prompts, each sampled ``n_samples_per_prompt`` times with the same options."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingOptions
    n_samples_per_prompt: int
    # P entries (or empty): each prompt's images/videos, None for a text-only prompt. A prompt with media holds
    # one unexpanded placeholder per item; the engine's processor expands them.
    media: tuple[media_pb2.PromptMedia | None, ...] = ()
    # Set by the generator's servicer: the same media decoded (what engines read); empty for text-only requests.
    decoded_media: tuple[DecodedMedia | None, ...] = ()

    def media_of(self, index: int) -> media_pb2.PromptMedia | None:
        return self.media[index] if self.media else None

    def decoded_media_of(self, index: int) -> DecodedMedia | None:
        return self.decoded_media[index] if self.decoded_media else None


@dataclass(frozen=True)
class CompletionRecord:
    """One finished sample.

    ``output_log_probs`` is float32 ``(T,)``, ``T = len(output_token_ids)``: the log-prob (nats) of each sampled
    token under the engine's raw, untempered next-token distribution (vLLM's ``raw_logprobs`` mode).
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    output_log_probs: np.ndarray
    finish_reason: FinishReason
    text: str
    policy_version: int


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


class GenerationEngine(Protocol):
    """An inference engine that samples completions (cf. vLLM's ``EngineClient``)."""

    description: ModelDescription

    @property
    def policy_version(self) -> int:
        """Version of the weights in use: 0 at start, +1 per weight update."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[CompletionRecord]:
        """Yield each of the ``P * n`` completions as soon as it finishes (order unspecified).

        Closing or cancelling the iterator aborts the request's unfinished samples.
        """
        ...

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    async def update_weights(self, kind: str, folder: str) -> int:
        """Apply the update in ``folder`` (``kind``: "staged" or "checkpoint"; already checked) between steps.

        Samples in flight finish under the old weights and carry the old version; samples started after it
        returns use the new weights. Returns the new policy version (previous + 1).
        """
        ...

    async def check_health(self) -> None:
        """Return if the engine can serve; raise otherwise."""
        ...

    async def close(self) -> None:
        """Stop the engine and free its resources."""
        ...

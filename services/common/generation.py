"""Records the generator and the experience service exchange: a generation request and one finished sample.

Both services use them (the experience service builds requests and reads completions through its gRPC client;
the generator's servicer decodes the same request and its engines produce the completions), so they live here,
below both. Nothing here imports gRPC or generated protobuf classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from fastexp.sampling import SamplingOptions
from services.common.media import DecodedMedia, EncodedMedia

FinishReason = Literal["stop", "length", "abort"]
#: The feature a generator lists (``ModelInfo.features``) when ``SetCpuThreads`` adjusts its engine's threads.
CPU_THREADS = "cpu-threads"


@dataclass(frozen=True)
class GenerationRequest:
    """P tokenized prompts, each sampled ``n_samples_per_prompt`` times with the same options."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingOptions
    n_samples_per_prompt: int
    # P entries (or empty): each prompt's images/videos, None for a text-only prompt. A prompt with media holds
    # one unexpanded placeholder per item; the engine's processor expands them.
    media: tuple[EncodedMedia | None, ...] = ()
    # Set by the generator's servicer: the same media decoded (what engines read); empty for text-only requests.
    decoded_media: tuple[DecodedMedia | None, ...] = ()
    # The experience service's routing hint (never sent): requests with one key go to the replica that holds their
    # prefix in its KV cache, e.g. the turns of one multi-turn episode. None: the prompt's own tokens.
    affinity_key: str | None = None
    # The LoRA adapter to sample with (the generator's name for it: a LoRA run's id); None: the base model. Every
    # sample then carries the adapter's version as its policy_version.
    adapter: str | None = None

    def media_of(self, index: int) -> EncodedMedia | None:
        return self.media[index] if self.media else None

    def decoded_media_of(self, index: int) -> DecodedMedia | None:
        return self.decoded_media[index] if self.decoded_media else None


@dataclass(frozen=True)
class CompletionRecord:
    """One finished sample.

    ``output_log_probs`` is float32 ``(T,)``, ``T = len(output_token_ids)``: the log-prob (nats) of each sampled
    token under the engine's raw, untempered next-token distribution (vLLM's ``raw_logprobs`` mode). A multi-turn
    episode is one record too: see ``action_mask``.
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    output_log_probs: np.ndarray
    finish_reason: FinishReason
    text: str
    policy_version: int
    # Multi-turn episodes (services.experience.pipeline.episodes): output_token_ids are the whole episode after the prompt,
    # model turns and the environment's observations; action_mask is 1 on the model's sampled tokens, 0 on
    # observation tokens (output_log_probs 0 there). None: every output token is the model's (one turn).
    action_mask: tuple[int, ...] | None = None
    num_turns: int = 1

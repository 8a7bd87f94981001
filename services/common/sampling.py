"""Sampling options as a validated domain record, shared by the generator and the experience service."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastexp.v1 import generation_pb2
from services.common.errors import InvalidRequest


@dataclass(frozen=True)
class RequestLimits:
    """Operator limits every generation request is checked against."""

    max_prompts_per_request: int
    max_samples_per_prompt: int
    max_new_tokens_limit: int
    default_max_new_tokens: int


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters for every sample of a request.

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` disables top-k. Sample ``j`` of a prompt uses
    ``seed + j`` when ``seed`` is set (vLLM); the HF backend seeds the whole request once.
    ``first_token_temperature`` (FIRE, Chen et al. 2024, arXiv 2410.21236): the first response token's softmax
    temperature; ``None`` uses ``temperature`` for every token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    seed: int | None = None
    first_token_temperature: float | None = None

    def temperature_at(self, position: int) -> float:
        """The temperature response token ``position`` (0-based) is sampled at."""
        if position == 0 and self.first_token_temperature is not None:
            return self.first_token_temperature
        return self.temperature

    @classmethod
    def from_pb(
        cls,
        message: generation_pb2.SamplingParams,
        *,
        default_max_new_tokens: int,
        max_new_tokens_limit: int,
        field: str = "sampling",
    ) -> SamplingOptions:
        """Validate ``message``; unset fields take the defaults above.

        Raises:
            InvalidRequest: naming the first invalid field, e.g. ``sampling.temperature``.
        """
        temperature = message.temperature if message.HasField("temperature") else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest(f"{field}.temperature", f"must be finite and >= 0, got {temperature}")
        top_p = message.top_p if message.HasField("top_p") else 1.0
        if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
            raise InvalidRequest(f"{field}.top_p", f"must be in (0, 1], got {top_p}")
        top_k = message.top_k if message.HasField("top_k") else 0
        if top_k < 0:
            raise InvalidRequest(f"{field}.top_k", f"must be >= 0 (0 disables), got {top_k}")
        max_new_tokens = message.max_new_tokens or default_max_new_tokens
        if max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest(
                f"{field}.max_new_tokens", f"at most {max_new_tokens_limit} allowed, got {max_new_tokens}"
            )
        if message.min_new_tokens > max_new_tokens:
            raise InvalidRequest(
                f"{field}.min_new_tokens",
                f"must not exceed max_new_tokens ({max_new_tokens}), got {message.min_new_tokens}",
            )
        first_token_temperature = None
        if message.HasField("first_token_temperature"):
            first_token_temperature = message.first_token_temperature
            if not math.isfinite(first_token_temperature) or first_token_temperature <= 0:
                raise InvalidRequest(
                    f"{field}.first_token_temperature", f"must be finite and > 0, got {first_token_temperature}"
                )
            if temperature == 0:
                raise InvalidRequest(
                    f"{field}.first_token_temperature", "needs temperature > 0 (greedy decoding has no first-token "
                    "temperature)"
                )
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            min_new_tokens=message.min_new_tokens,
            skip_special_tokens=message.skip_special_tokens,
            seed=message.seed if message.HasField("seed") else None,
            first_token_temperature=first_token_temperature,
        )

    def to_pb(self) -> generation_pb2.SamplingParams:
        """The same options as a ``SamplingParams`` message (for forwarding to the generator)."""
        message = generation_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            skip_special_tokens=self.skip_special_tokens,
        )
        if self.seed is not None:
            message.seed = self.seed
        if self.first_token_temperature is not None:
            message.first_token_temperature = self.first_token_temperature
        return message


def validate_batch(
    num_prompts: int, n_samples_per_prompt: int, sampling: generation_pb2.SamplingParams, limits: RequestLimits
) -> SamplingOptions:
    """Check the prompt count and ``n_samples_per_prompt`` against ``limits``, then decode ``sampling``.

    Raises:
        InvalidRequest: naming ``prompts``, ``n_samples_per_prompt`` or the ``sampling.*`` field.
    """
    if num_prompts == 0:
        raise InvalidRequest("prompts", "at least one prompt is required")
    if num_prompts > limits.max_prompts_per_request:
        raise InvalidRequest("prompts", f"at most {limits.max_prompts_per_request} prompts per request")
    if n_samples_per_prompt < 1:
        raise InvalidRequest("n_samples_per_prompt", "must be >= 1")
    if n_samples_per_prompt > limits.max_samples_per_prompt:
        raise InvalidRequest("n_samples_per_prompt", f"at most {limits.max_samples_per_prompt} allowed")
    return SamplingOptions.from_pb(
        sampling,
        default_max_new_tokens=limits.default_max_new_tokens,
        max_new_tokens_limit=limits.max_new_tokens_limit,
    )

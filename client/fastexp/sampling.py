"""Sampling options: the record a trainer fills in and the services validate (``fastexp.v1.SamplingParams``;
its wire form: :func:`fastexp.wire.sampling_to_pb`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters for every sample of a request.

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` disables top-k. Sample ``j`` of a prompt uses
    ``seed + j`` when ``seed`` is set (vLLM); the HF backend seeds the whole request once.
    ``first_token_temperature`` (FIRE, Chen et al. 2024, arXiv 2410.21236): the first response token's softmax
    temperature; ``None`` uses ``temperature`` for every token.
    ``skip_special_tokens`` is False by default, as in the proto and the seed: response texts (and so the queries
    reward models and rule functions see) keep special tokens such as EOS. ``ignore_eos`` keeps sampling after
    EOS until ``max_new_tokens`` (vLLM's ``ignore_eos``; the seed's ``IGNORE_EOS``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    skip_special_tokens: bool = False
    seed: int | None = None
    first_token_temperature: float | None = None
    ignore_eos: bool = False

    def temperature_at(self, position: int) -> float:
        """The temperature response token ``position`` (0-based) is sampled at."""
        if position == 0 and self.first_token_temperature is not None:
            return self.first_token_temperature
        return self.temperature

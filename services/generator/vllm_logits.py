"""vLLM logits processors (loaded by vLLM's engine from ``logits_processors``; run inside its worker processes).

:class:`FirstTokenTemperature` implements FIRE sampling (Chen et al. 2024, "Flaming-hot Initiation with Regular
Execution Sampling for Large Language Models", arXiv 2410.21236) for the vLLM backend: a request whose
``SamplingParams.extra_args`` carries ``first_token_temperature`` has its first response token sampled at that
temperature and every later token at its ``temperature``; top-p/top-k/min-tokens apply unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

#: ``SamplingParams.extra_args`` key read by :class:`FirstTokenTemperature`.
FIRST_TOKEN_TEMPERATURE = "first_token_temperature"


class FirstTokenTemperature(LogitsProcessor):
    """Scales a row's logits by ``temperature / first_token_temperature`` while it has no output token yet.

    vLLM runs non-argmax-invariant processors before dividing by the request's temperature, so the first token is
    sampled from ``softmax(logits / first_token_temperature)``. The engine's raw log-probs are computed before any
    processor, so ``output_log_probs`` stay untempered.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._scales: dict[int, tuple[float, list[int]]] = {}  # batch row -> (scale, live output token ids)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        value = (sampling_params.extra_args or {}).get(FIRST_TOKEN_TEMPERATURE)
        if value is not None and not (float(value) > 0 and sampling_params.temperature > 0):
            raise ValueError(f"{FIRST_TOKEN_TEMPERATURE} needs a value > 0 and temperature > 0, got {value}")

    def is_argmax_invariant(self) -> bool:
        return False  # must run before the temperature division (and so also on greedy rows, where it is unset)

    @staticmethod
    def _new_state(
        params: SamplingParams, prompt_tok_ids: list[int] | None, output_tok_ids: list[int]
    ) -> tuple[float, list[int]] | None:
        value = (params.extra_args or {}).get(FIRST_TOKEN_TEMPERATURE)
        if value is None or output_tok_ids:
            return None
        return params.temperature / float(value), output_tok_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._scales, batch_update, self._new_state)
        for row in [row for row, (_, output) in self._scales.items() if output]:
            del self._scales[row]  # past the first token

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (scale, _) in self._scales.items():
            logits[row] *= scale
        return logits

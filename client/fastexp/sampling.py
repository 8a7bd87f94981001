"""Sampling options: the record a trainer fills in and the services validate (``fastexp.v1.SamplingParams``;
its wire form: :func:`fastexp.wire.sampling_to_pb`).

The record checks each field's range when it is built (:class:`InvalidSampling`); the services build it from the
wire through the same checks (``services.common.sampling.sampling_from_pb``), so a field has one range, stated
here. What depends on the service is the service's to check: ``max_new_tokens`` against the operator's limit and,
once the service's default fills an unset ``max_new_tokens``, ``min_new_tokens <= max_new_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_INT32 = 2**31 - 1  # the wire's int32 top_k
_UINT32 = 2**32 - 1  # the wire's uint32 token counts
_UINT64 = 2**64 - 1  # the wire's uint64 seed


class InvalidSampling(ValueError):
    """A :class:`SamplingOptions` field outside its range; ``field`` names it (``temperature``), ``reason`` says
    why (the services answer INVALID_ARGUMENT with ``sampling.<field>: <reason>``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"SamplingOptions.{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling parameters for every sample of a request.

    ``temperature`` (finite, >= 0; 0 means greedy decoding); ``top_p`` in (0, 1]; ``top_k`` >= 0, where 0 and -1
    (the seed's and vLLM's spelling, stored as 0) disable top-k. ``max_new_tokens`` (>= 1): most tokens sampled per
    response; default: the service's (its ``default_max_new_tokens``, 256 unless the operator changes it: None
    stays unset on the wire; the services always decode a number). ``min_new_tokens`` (>= 0)
    suppresses EOS until that many tokens were sampled. Sample ``j`` of a prompt uses ``seed + j`` when ``seed``
    (0 to 2**64 - 1) is set (vLLM); the HF backend seeds the whole request once.
    ``first_token_temperature`` (FIRE, Chen et al. 2024, arXiv 2410.21236): the first response token's softmax
    temperature (finite, > 0; needs ``temperature > 0``); ``None`` uses ``temperature`` for every token.
    ``skip_special_tokens`` is False by default, as in the proto and the seed: response texts (and so the queries
    reward models and rule functions see) keep special tokens such as EOS. ``ignore_eos`` keeps sampling after
    EOS until ``max_new_tokens`` (vLLM's ``ignore_eos``; the seed's ``IGNORE_EOS``).

    Raises:
        TypeError: a field of the wrong type (``top_k=1.5``, ``temperature="1"``), naming it.
        InvalidSampling: (a ValueError) a field outside its range, the first in the order above; ``field`` names it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    skip_special_tokens: bool = False
    seed: int | None = None
    first_token_temperature: float | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _check_ranges(self)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def temperature_at(self, position: int) -> float:
        """The temperature response token ``position`` (0-based) is sampled at."""
        if position == 0 and self.first_token_temperature is not None:
            return self.first_token_temperature
        return self.temperature


_FLOATS = ("temperature", "top_p", "first_token_temperature")
_INTS = ("top_k", "max_new_tokens", "min_new_tokens", "seed")
_BOOLS = ("skip_special_tokens", "ignore_eos")


def _check_types(options: SamplingOptions) -> None:
    for name in (*_FLOATS, *_INTS, *_BOOLS):
        value = getattr(options, name)
        if value is None and name in ("max_new_tokens", "seed", "first_token_temperature"):
            continue
        if name in _BOOLS:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, float | int if name in _FLOATS else int) and not isinstance(value, bool)
        if not ok:
            expected = "a bool" if name in _BOOLS else "a number" if name in _FLOATS else "an int"
            raise TypeError(f"SamplingOptions.{name}: {type(value).__name__}, expected {expected}")


def _check_ranges(o: SamplingOptions) -> None:
    """The ranges each field's meaning gives it; the messages are the services' (``sampling.<field>: ...``)."""
    if not math.isfinite(o.temperature) or o.temperature < 0:
        raise InvalidSampling("temperature", f"must be finite and >= 0, got {o.temperature}")
    if not math.isfinite(o.top_p) or not 0.0 < o.top_p <= 1.0:
        raise InvalidSampling("top_p", f"must be in (0, 1], got {o.top_p}")
    if o.top_k < -1:
        raise InvalidSampling("top_k", f"must be >= 0, or -1 (0 and -1 disable), got {o.top_k}")
    if o.top_k > _INT32:
        raise InvalidSampling("top_k", f"at most {_INT32} (int32), got {o.top_k}")
    if o.max_new_tokens is not None and not 1 <= o.max_new_tokens <= _UINT32:
        raise InvalidSampling("max_new_tokens", f"must be in [1, {_UINT32}] (None: the service's default), got "
                                                f"{o.max_new_tokens}")
    if not 0 <= o.min_new_tokens <= _UINT32:
        raise InvalidSampling("min_new_tokens", f"must be in [0, {_UINT32}], got {o.min_new_tokens}")
    if o.seed is not None and not 0 <= o.seed <= _UINT64:
        raise InvalidSampling("seed", f"must be in [0, 2**64 - 1], got {o.seed}")
    if o.first_token_temperature is not None:
        if not math.isfinite(o.first_token_temperature) or o.first_token_temperature <= 0:
            raise InvalidSampling("first_token_temperature", f"must be finite and > 0, got {o.first_token_temperature}")
        if o.temperature == 0:
            raise InvalidSampling("first_token_temperature", "needs temperature > 0 (greedy decoding has no "
                                                             "first-token temperature)")

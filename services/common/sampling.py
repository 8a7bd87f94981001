"""Validating a request's sampling options and size against the operator's limits (generator and experience).

The record itself, :class:`fastexp.sampling.SamplingOptions`, is the trainer SDK's and checks each field's range;
the services build it only through :func:`sampling_from_pb`, which adds the operator's limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastexp.sampling import InvalidSampling, SamplingOptions
from fastexp.v1 import generation_pb2
from services.common.errors import InvalidRequest, Overloaded

#: Default cap on prompts x n_samples_per_prompt x max_new_tokens of one request (64 Mi tokens: 1024 prompts x 16
#: samples x 4096 tokens).
DEFAULT_MAX_TOKENS_PER_REQUEST = 1 << 26


@dataclass(frozen=True)
class RequestLimits:
    """Operator limits every generation request is checked against."""

    max_prompts_per_request: int
    max_samples_per_prompt: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    max_tokens_per_request: int = DEFAULT_MAX_TOKENS_PER_REQUEST


def sampling_from_pb(
    message: generation_pb2.SamplingParams,
    *,
    default_max_new_tokens: int,
    max_new_tokens_limit: int,
    field: str = "sampling",
) -> SamplingOptions:
    """Validate ``message`` into :class:`SamplingOptions`: each field's range is the record's own check
    (:class:`~fastexp.sampling.InvalidSampling`); unset fields take the record's defaults, and an unset (0)
    ``max_new_tokens`` ``default_max_new_tokens``. Then the service's checks: ``max_new_tokens`` at most
    ``max_new_tokens_limit``, ``min_new_tokens`` at most ``max_new_tokens``.

    Raises:
        InvalidRequest: naming the first invalid field, e.g. ``sampling.temperature``.
    """
    set_fields = {name: getattr(message, name) for name in _OPTIONAL if message.HasField(name)}
    try:
        options = SamplingOptions(
            **set_fields, max_new_tokens=message.max_new_tokens or default_max_new_tokens,
            min_new_tokens=message.min_new_tokens, skip_special_tokens=message.skip_special_tokens,
            ignore_eos=message.ignore_eos,
        )
    except InvalidSampling as error:
        raise InvalidRequest(f"{field}.{error.field}", error.reason) from None
    if options.max_new_tokens > max_new_tokens_limit:
        raise InvalidRequest(
            f"{field}.max_new_tokens", f"at most {max_new_tokens_limit} allowed, got {options.max_new_tokens}"
        )
    if options.min_new_tokens > options.max_new_tokens:
        raise InvalidRequest(
            f"{field}.min_new_tokens",
            f"must not exceed max_new_tokens ({options.max_new_tokens}), got {options.min_new_tokens}",
        )
    return options


#: ``SamplingParams`` fields with presence: unset ones take :class:`SamplingOptions`' defaults.
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "first_token_temperature")


def validate_batch(
    num_prompts: int, n_samples_per_prompt: int, sampling: generation_pb2.SamplingParams, limits: RequestLimits
) -> SamplingOptions:
    """Check the prompt count and ``n_samples_per_prompt`` against ``limits``, decode ``sampling``, then check
    the request's token budget (:func:`check_token_budget`).

    Raises:
        InvalidRequest: naming ``prompts``, ``n_samples_per_prompt`` or the ``sampling.*`` field.
        Overloaded: over ``max_tokens_per_request`` (RESOURCE_EXHAUSTED).
    """
    if num_prompts == 0:
        raise InvalidRequest("prompts", "at least one prompt is required")
    if num_prompts > limits.max_prompts_per_request:
        raise InvalidRequest("prompts", f"at most {limits.max_prompts_per_request} prompts per request")
    if n_samples_per_prompt < 1:
        raise InvalidRequest("n_samples_per_prompt", "must be >= 1")
    if n_samples_per_prompt > limits.max_samples_per_prompt:
        raise InvalidRequest("n_samples_per_prompt", f"at most {limits.max_samples_per_prompt} allowed")
    options = sampling_from_pb(
        sampling,
        default_max_new_tokens=limits.default_max_new_tokens,
        max_new_tokens_limit=limits.max_new_tokens_limit,
    )
    check_token_budget(num_prompts, n_samples_per_prompt, options.max_new_tokens, limits.max_tokens_per_request)
    return options


def check_token_budget(num_prompts: int, n_samples_per_prompt: int, max_new_tokens: int, cap: int) -> None:
    """Refuse a request that may generate more than ``cap`` tokens: prompts x samples x max_new_tokens.

    Raises:
        Overloaded: naming ``max_tokens_per_request``, the three factors and the cap (RESOURCE_EXHAUSTED).
    """
    total = num_prompts * n_samples_per_prompt * max_new_tokens
    if total > cap:
        raise Overloaded(
            f"max_tokens_per_request: {num_prompts} prompts x {n_samples_per_prompt} n_samples_per_prompt x "
            f"{max_new_tokens} max_new_tokens = {total} tokens, over the cap of {cap}; split the request"
        )

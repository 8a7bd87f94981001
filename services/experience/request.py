"""Decode and validate a ``MakeExperiencesRequest`` into an immutable :class:`ExperienceRequest`.

All validation happens here, before any generation starts; every error names the request field.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from fastexp.v1 import experience_pb2
from services.common.errors import InvalidRequest
from services.common.sampling import RequestLimits, SamplingOptions, validate_batch
from services.experience.advantages import ALIASES, ESTIMATORS, AdvantageEstimator, get_estimator
from services.experience.kl import KL_ESTIMATORS

DEFAULT_ESTIMATOR = "group_norm"
DEFAULT_KL_COEF = 0.01


@dataclass(frozen=True)
class PromptSpec:
    """One prompt as the policy sees it: rendered text, its token ids, and its supervision."""

    text: str
    token_ids: tuple[int, ...]
    reference: str
    label: str


@dataclass(frozen=True)
class ExperienceConfig:
    """How rewards become advantages (plain values, never a request or settings object)."""

    n_samples_per_prompt: int
    micro_rollout_batch_size: int
    estimator: AdvantageEstimator
    kl_coef: float
    kl_estimator: str
    use_kl_loss: bool
    gamma: float

    @property
    def groups_per_batch(self) -> int:
        """Whole prompt groups per ExperienceBatch: ``max(1, micro_rollout_batch_size // n)``."""
        return max(1, self.micro_rollout_batch_size // self.n_samples_per_prompt)


@dataclass(frozen=True)
class ExperienceRequest:
    request_id: str
    prompts: tuple[PromptSpec, ...]
    sampling: SamplingOptions
    config: ExperienceConfig


def decode_request(
    message: experience_pb2.MakeExperiencesRequest, tokenizer: Any, limits: RequestLimits, max_model_len: int
) -> ExperienceRequest:
    """Validate ``message``, render chat prompts with ``tokenizer``'s chat template and tokenize every prompt.

    ``max_model_len`` is the generator's limit on prompt + response tokens; a prompt must be shorter.

    Raises:
        InvalidRequest: naming the offending field, e.g. ``prompts[2]``, ``sampling.top_p``,
            ``advantage_estimator``.
    """
    sampling = validate_batch(len(message.prompts), message.n_samples_per_prompt, message.sampling, limits)
    config = _decode_config(message, message.n_samples_per_prompt)
    prompts = tuple(_render_prompt(i, p, tokenizer, max_model_len) for i, p in enumerate(message.prompts))
    return ExperienceRequest(
        request_id=message.request_id or uuid.uuid4().hex, prompts=prompts, sampling=sampling, config=config
    )


def _decode_config(message: experience_pb2.MakeExperiencesRequest, n: int) -> ExperienceConfig:
    name = message.advantage_estimator or DEFAULT_ESTIMATOR
    try:
        estimator = get_estimator(name)
    except KeyError:
        known = ", ".join(sorted([*ESTIMATORS, *ALIASES]))
        raise InvalidRequest("advantage_estimator", f"unknown estimator {name!r}; known: {known}") from None
    if n < estimator.min_samples_per_prompt:
        raise InvalidRequest(
            "n_samples_per_prompt",
            f"{estimator.name} needs n_samples_per_prompt >= {estimator.min_samples_per_prompt}: {estimator.why_min}",
        )
    kl_coef = message.kl.kl_coef if message.kl.HasField("kl_coef") else DEFAULT_KL_COEF
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise InvalidRequest("kl.kl_coef", f"must be finite and >= 0, got {kl_coef}")
    kl_estimator = message.kl.kl_estimator or "k1"
    if kl_estimator not in KL_ESTIMATORS:
        raise InvalidRequest("kl.kl_estimator", f"unknown {kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    gamma = message.gamma if message.HasField("gamma") else 1.0
    if not math.isfinite(gamma) or not 0.0 < gamma <= 1.0:
        raise InvalidRequest("gamma", f"must be in (0, 1], got {gamma}")
    return ExperienceConfig(
        n_samples_per_prompt=n,
        micro_rollout_batch_size=message.micro_rollout_batch_size,
        estimator=estimator,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        use_kl_loss=message.kl.use_kl_loss,
        gamma=gamma,
    )


def _render_prompt(index: int, prompt: experience_pb2.PromptInput, tokenizer: Any, max_model_len: int) -> PromptSpec:
    field = f"prompts[{index}]"
    kind = prompt.WhichOneof("prompt")
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in prompt.chat.messages]
        if not messages:
            raise InvalidRequest(f"{field}.chat", "a conversation needs at least one message")
        if any(not m["role"] for m in messages):
            raise InvalidRequest(f"{field}.chat", "every message needs a role")
        if tokenizer.chat_template is None:
            raise InvalidRequest(f"{field}.chat", "the policy has no chat template; send text prompts")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif kind == "text":
        text = prompt.text
    else:
        raise InvalidRequest(field, "set text or chat")
    if not text:
        raise InvalidRequest(field, "prompt is empty")
    ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InvalidRequest(field, "prompt is empty after tokenization")
    if len(ids) >= max_model_len:
        raise InvalidRequest(field, f"{len(ids)} tokens; the model's limit is {max_model_len} (prompt + response)")
    return PromptSpec(text=text, token_ids=ids, reference=prompt.reference, label=prompt.label)

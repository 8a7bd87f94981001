"""Decode and validate a ``MakeExperiencesRequest`` into an immutable :class:`ExperienceRequest`.

All validation happens here, before any generation starts; every error names the request field.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from fastexp.rl.advantages import ALIASES, ESTIMATORS, AdvantageEstimator, get_estimator
from fastexp.rl.kl import KL_ESTIMATORS
from fastexp.rl.options import DEFAULT_KL_COEF, DEFAULT_KL_HORIZON, AdvantageOptions, KLOptions, RewardOptions
from fastexp.rl.rollout_correction import DEFAULT_THRESHOLD, RolloutCorrectionOptions
from fastexp.sampling import SamplingOptions
from fastexp.v1 import experience_pb2
from services.common.errors import InvalidRequest
from services.common.media import MediaLimits, check_pixel_budget
from services.common.media_wire import media_from_pb
from services.common.sampling import RequestLimits, validate_batch
from services.experience.api.prompts import render_prompts
from services.experience.config import (
    DEFAULT_MAX_EXTRA_ROUNDS,
    DEFAULT_MAX_TURNS,
    AgentOptions,
    DynamicSamplingOptions,
    EpisodeOptions,
    ExperienceConfig,
    ExperienceRequest,
)
from services.experience.runs.limits import MAX_RUN_ID_CHARS
from services.experience.workers.vision import VisionProcessor

DEFAULT_ESTIMATOR = "group_norm"
MAX_EXTRA_ROUNDS = 16
DEFAULT_MEDIA_LIMITS = MediaLimits()
MAX_STALENESS = 1024  # policy versions; larger bounds are "unbounded" in practice: leave max_staleness unset
#: Most model turns a request may ask per episode.
MAX_TURNS_LIMIT = 64

def decode_request(
    message: experience_pb2.MakeExperiencesRequest,
    tokenizer: Any,
    limits: RequestLimits,
    max_model_len: int,
    has_critic: bool = False,
    vision: VisionProcessor | None = None,
    media_limits: MediaLimits = DEFAULT_MEDIA_LIMITS,
) -> ExperienceRequest:
    """Validate ``message``, render chat prompts with ``tokenizer``'s chat template and tokenize every prompt.

    ``max_model_len`` is the generator's limit on prompt + response tokens; a prompt must be shorter.
    ``has_critic`` says whether this service runs a value model (``gae`` needs one). ``vision`` is the policy's
    processor for a vision-language policy (None: text-only policy, images are refused); prompts with images or
    videos are rendered and processed by it, text-only ones by ``tokenizer``.

    Raises:
        InvalidRequest: naming the offending field, e.g. ``sampling.top_p``, ``advantage_estimator``, ``lambd``,
            ``reward_processing.reward_clip``.
        InvalidPrompts: every invalid prompt, named with its index (``prompts[2].images[0]``).
        Overloaded: over ``max_tokens_per_request`` or ``max_request_pixels`` (RESOURCE_EXHAUSTED).
    """
    sampling = validate_batch(len(message.prompts), message.n_samples_per_prompt, message.sampling, limits)
    config = _decode_config(message, message.n_samples_per_prompt, sampling, has_critic)
    check_pixel_budget([media_from_pb(p.images, p.videos) for p in message.prompts], media_limits.max_request_pixels)
    rendered = render_prompts(message, tokenizer, max_model_len, vision, media_limits)
    prompts = rendered.prompts
    if any(p.vision is not None for p in prompts):
        _check_multimodal_config(config)
    return ExperienceRequest(
        request_id=message.request_id or uuid.uuid4().hex, prompts=tuple(prompts), sampling=sampling, config=config,
        prompt_indices=rendered.prompt_indices, skipped_prompt_indices=rendered.skipped_prompt_indices,
        truncated_prompt_indices=rendered.truncated_prompt_indices,
    )


def _check_multimodal_config(config: ExperienceConfig) -> None:
    """What multimodal prompts cannot be combined with (yet)."""
    if config.packing_samples or config.return_packed:
        field = "packing_samples" if config.packing_samples else "return_packed"
        raise InvalidRequest(field, "not supported with image/video prompts (their M-RoPE positions need padded rows)")
    if config.estimator.needs_critic:
        raise InvalidRequest("advantage_estimator", f"{config.estimator.name}'s critic is text-only; "
                             "image/video prompts need a critic-free estimator")
    if config.episodes is not None:
        raise InvalidRequest("environment", "multi-turn episodes take text-only prompts (for now)")
    if config.agent is not None:
        raise InvalidRequest("agent", "agent episodes take text-only prompts (for now)")


def _unit_interval(message: Any, field: str, default: float) -> float:
    value = getattr(message, field) if message.HasField(field) else default
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise InvalidRequest(field, f"must be in [0, 1], got {value}")
    return value


def _non_negative(value: float, field: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(field, f"must be finite and >= 0, got {value}")
    return value


def _decode_config(
    message: experience_pb2.MakeExperiencesRequest, n: int, sampling: SamplingOptions, has_critic: bool
) -> ExperienceConfig:
    name = message.advantage_estimator or DEFAULT_ESTIMATOR
    try:
        estimator = get_estimator(name)
    except KeyError:
        known = ", ".join(sorted([*ESTIMATORS, *ALIASES]))
        raise InvalidRequest("advantage_estimator", f"unknown estimator {name!r}; known: {known}") from None
    if estimator.needs_critic and not has_critic:
        raise InvalidRequest(
            "advantage_estimator", f"{estimator.name} needs a critic and this service runs none (set critic_model)"
        )
    if n < estimator.min_samples_per_prompt:
        raise InvalidRequest(
            "n_samples_per_prompt",
            f"{estimator.name} needs n_samples_per_prompt >= {estimator.min_samples_per_prompt}: {estimator.why_min}",
        )
    if message.skip_actor_forward and message.return_action_entropy:
        raise InvalidRequest("return_action_entropy", "the actor's entropy needs its forward: not with skip_actor_forward")
    if len(message.run_id) > MAX_RUN_ID_CHARS:
        raise InvalidRequest("run_id", f"at most {MAX_RUN_ID_CHARS} characters, got {len(message.run_id)}")
    return ExperienceConfig(
        n_samples_per_prompt=n,
        estimator=estimator,
        micro_rollout_batch_size=message.micro_rollout_batch_size,
        kl=_decode_kl(message.kl),
        gamma=_unit_interval(message, "gamma", 1.0),
        lambd=_unit_interval(message, "lambd", 1.0),
        reward=_decode_reward(message.reward_processing, sampling.max_new_tokens),
        advantage=AdvantageOptions(
            advantages_norm=message.advantage_processing.advantages_norm,
            advantage_clip=_non_negative(
                message.advantage_processing.advantage_clip, "advantage_processing.advantage_clip"
            ),
        ),
        dynamic_sampling=_decode_dynamic_sampling(message.dynamic_sampling, n, len(message.prompts)),
        run_id=message.run_id,
        return_action_entropy=message.return_action_entropy,
        packing_samples=message.packing_samples,
        return_packed=message.return_packed,
        max_staleness=_decode_max_staleness(message),
        abort_partial_rollouts=_decode_partial_rollout(message.partial_rollout),
        normalization_scope=_decode_normalization_scope(message),
        skip_actor_forward=message.skip_actor_forward,
        episodes=_decode_episodes(message),
        agent=_decode_agent(message, estimator),
        rollout_correction=_decode_rollout_correction(message),
    )


_CORRECTION_LEVELS = {
    experience_pb2.ROLLOUT_CORRECTION_TOKEN: "token", experience_pb2.ROLLOUT_CORRECTION_SEQUENCE: "sequence",
}


def _decode_rollout_correction(message: experience_pb2.MakeExperiencesRequest) -> RolloutCorrectionOptions | None:
    correction = message.rollout_correction
    if correction.level == experience_pb2.ROLLOUT_CORRECTION_OFF:
        if correction.HasField("threshold"):
            raise InvalidRequest("rollout_correction.threshold", "set a level (TOKEN or SEQUENCE) with it")
        return None
    if correction.level not in _CORRECTION_LEVELS:
        raise InvalidRequest("rollout_correction.level", f"unknown value {correction.level}")
    if message.skip_actor_forward:
        raise InvalidRequest("rollout_correction.level", "needs the actor forward: not with skip_actor_forward "
                             "(the weights would all be 1)")
    threshold = correction.threshold if correction.HasField("threshold") else DEFAULT_THRESHOLD
    if not math.isfinite(threshold) or threshold < 1.0:
        raise InvalidRequest("rollout_correction.threshold", f"must be finite and >= 1, got {threshold}")
    return RolloutCorrectionOptions(_CORRECTION_LEVELS[correction.level], threshold)


def _decode_episodes(message: experience_pb2.MakeExperiencesRequest) -> EpisodeOptions | None:
    if not message.environment:
        if message.max_turns or message.max_total_tokens:
            field = "max_turns" if message.max_turns else "max_total_tokens"
            raise InvalidRequest(field, "only with an environment (multi-turn episodes)")
        return None
    max_turns = message.max_turns or DEFAULT_MAX_TURNS
    if max_turns > MAX_TURNS_LIMIT:
        raise InvalidRequest("max_turns", f"at most {MAX_TURNS_LIMIT}, got {max_turns}")
    if message.dynamic_sampling.enabled:
        raise InvalidRequest("dynamic_sampling", "not with an environment yet (episodes are not resampled)")
    if message.partial_rollout == experience_pb2.PARTIAL_ROLLOUT_ABORT:
        raise InvalidRequest("partial_rollout", "ABORT is not supported with an environment yet (episodes finish)")
    return EpisodeOptions(message.environment, max_turns, message.max_total_tokens)


def _decode_agent(message: experience_pb2.MakeExperiencesRequest, estimator: AdvantageEstimator) -> AgentOptions | None:
    """The request's agent (its name is checked against the operator's map by the servicer)."""
    if not message.HasField("agent"):
        return None
    agent = message.agent
    if not agent.name:
        raise InvalidRequest("agent.name", "name one of the operator's agents")
    if message.environment:
        raise InvalidRequest("agent", "an episode runs in an environment or an agent, not both")
    if message.dynamic_sampling.enabled:
        raise InvalidRequest("dynamic_sampling", "not with an agent yet (episodes are not resampled)")
    if message.partial_rollout == experience_pb2.PARTIAL_ROLLOUT_ABORT:
        raise InvalidRequest("partial_rollout", "ABORT is not supported with an agent (episodes finish)")
    if estimator.groups_rows:  # its token stage views rows as (G, n): a drift-split episode has several rows
        raise InvalidRequest("advantage_estimator", f"{estimator.name} takes one row per sample; agent episodes may split")
    return AgentOptions(agent.name, agent.max_calls or None)


def _decode_normalization_scope(message: experience_pb2.MakeExperiencesRequest) -> str:
    scope = message.normalization_scope
    if scope not in experience_pb2.NormalizationScope.values():
        raise InvalidRequest("normalization_scope", f"unknown value {scope}")
    if scope == experience_pb2.NORMALIZATION_SCOPE_ROLLOUT and message.HasField("max_staleness"):
        raise InvalidRequest(
            "normalization_scope",
            "ROLLOUT waits for the whole request before streaming; max_staleness needs batches to stream first",
        )
    return "rollout" if scope == experience_pb2.NORMALIZATION_SCOPE_ROLLOUT else "batch"


def _decode_max_staleness(message: experience_pb2.MakeExperiencesRequest) -> int | None:
    if not message.HasField("max_staleness"):
        return None
    if message.dynamic_sampling.enabled:
        raise InvalidRequest(
            "max_staleness", "is not supported together with dynamic_sampling (refill rounds have no batch index)"
        )
    if message.max_staleness > MAX_STALENESS:
        raise InvalidRequest("max_staleness", f"at most {MAX_STALENESS}, got {message.max_staleness}")
    return message.max_staleness


def _decode_partial_rollout(value: int) -> bool:
    if value not in experience_pb2.PartialRollout.values():
        raise InvalidRequest("partial_rollout", f"unknown value {value}")
    return value == experience_pb2.PARTIAL_ROLLOUT_ABORT


def _decode_kl(kl: experience_pb2.KLSettings) -> KLOptions:
    kl_coef = _non_negative(kl.kl_coef if kl.HasField("kl_coef") else DEFAULT_KL_COEF, "kl.kl_coef")
    kl_estimator = kl.kl_estimator or "k1"
    if kl_estimator not in KL_ESTIMATORS:
        raise InvalidRequest("kl.kl_estimator", f"unknown {kl_estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
    target = None
    if kl.HasField("kl_target"):
        target = kl.kl_target
        if not math.isfinite(target) or target <= 0:
            raise InvalidRequest("kl.kl_target", f"must be finite and > 0, got {target}")
    horizon = kl.kl_horizon if kl.HasField("kl_horizon") else DEFAULT_KL_HORIZON
    if horizon < 1:
        raise InvalidRequest("kl.kl_horizon", "must be >= 1")
    return KLOptions(kl_coef, kl_estimator, kl.use_kl_loss, target, horizon)


def _decode_reward(reward: experience_pb2.RewardProcessing, max_new_tokens: int) -> RewardOptions:
    if reward.reward_running_norm_minus_mean and not reward.reward_running_norm:
        raise InvalidRequest(
            "reward_processing.reward_running_norm_minus_mean", "needs reward_processing.reward_running_norm"
        )
    buffer_len = 0
    factor = 1.0
    if reward.overlong_buffer:
        buffer_len = reward.overlong_buffer_len
        if not 1 <= buffer_len <= max_new_tokens:
            raise InvalidRequest(
                "reward_processing.overlong_buffer_len",
                f"must be in [1, sampling.max_new_tokens={max_new_tokens}] with overlong_buffer, got {buffer_len}",
            )
        if reward.HasField("overlong_buffer_penalty_factor"):
            factor = _non_negative(
                reward.overlong_buffer_penalty_factor, "reward_processing.overlong_buffer_penalty_factor"
            )
    return RewardOptions(
        reward_running_norm=reward.reward_running_norm,
        reward_running_norm_minus_mean=reward.reward_running_norm_minus_mean,
        reward_clip=_non_negative(reward.reward_clip, "reward_processing.reward_clip"),
        overlong_buffer_len=buffer_len,
        overlong_buffer_penalty_factor=factor,
        max_new_tokens=max_new_tokens,
    )


def _decode_dynamic_sampling(
    dynamic: experience_pb2.DynamicSampling, n: int, num_prompts: int
) -> DynamicSamplingOptions | None:
    if not dynamic.enabled:
        return None
    if n < 2:
        raise InvalidRequest("dynamic_sampling.enabled", "needs n_samples_per_prompt >= 2 (a group of one has no variance)")
    if not 1 <= dynamic.num_groups <= num_prompts:
        raise InvalidRequest(
            "dynamic_sampling.num_groups", f"must be in [1, len(prompts)={num_prompts}], got {dynamic.num_groups}"
        )
    rounds = dynamic.max_extra_rounds if dynamic.HasField("max_extra_rounds") else DEFAULT_MAX_EXTRA_ROUNDS
    if rounds > MAX_EXTRA_ROUNDS:
        raise InvalidRequest("dynamic_sampling.max_extra_rounds", f"at most {MAX_EXTRA_ROUNDS}, got {rounds}")
    return DynamicSamplingOptions(num_groups=dynamic.num_groups, max_extra_rounds=rounds)

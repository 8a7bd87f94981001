"""From rewards and forward passes to the final Experience: KL, reward shaping, returns, advantages (pure).

One function, :func:`estimate_experience`, runs the stages in the seed's order; each stage is a pure function of
:mod:`~fastexp.rl.kl`, :mod:`~fastexp.rl.processing`, :mod:`~fastexp.rl.advantages`
and :mod:`~fastexp.rl.rewards`. The run's state (running reward moments, beta) goes in and the updated
state comes out; nothing is mutated.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastexp.layout import EXPERIENCE_LAYOUT
from fastexp.rl.advantages import TokenInputs
from fastexp.rl.kl import compute_approx_kl
from fastexp.rl.options import EstimateConfig
from fastexp.rl.processing import (
    clip_with_fraction,
    episode_ids,
    overlong_penalty,
    running_normalize,
    sequence_mean_kl,
    whiten,
)
from fastexp.rl.rewards import compute_reward
from fastexp.rl.rollout_correction import rollout_correction
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.types import Experience, ForwardOutputs, Rollout


def estimate_experience(
    rollout: Rollout,
    reward: torch.Tensor,
    reward_metrics: dict[str, torch.Tensor],
    forward: ForwardOutputs,
    config: EstimateConfig,
    state: RunState,
    batch_index: int = 0,
    dropped_prompt_indices: tuple[int, ...] = (),
    counted: torch.Tensor | None = None,
) -> tuple[Experience, RunState]:
    """Compute KL, per-token rewards, returns and advantages for whole prompt groups.

    Stages (the seed's ``_process_experiences`` + ``_compute_advantages_and_returns``):

    1. ``kl = k(action_log_probs - base_action_log_probs)`` on ``action_mask`` (k1/k2/k3); ``None`` when no
       reference ran (``kl_coef == 0``, no ``kl_target``, no ``use_kl_loss``): then no KL term anywhere.
    2. ``R = reward + overlong_penalty(response_length)`` when ``overlong_buffer_len > 0``.
    3. ``R = estimator.shape_rewards(R as (G, n))`` (group baselines).

    Stages 2-5 run per *episode*: a row is its own episode except where an agent episode was split into several
    consecutive rows of one (prompt, sample) (:func:`~fastexp.rl.processing.episode_ids`); such an episode's reward
    is its first row's, its length the sum of its rows', and each of its rows gets the episode's shaped R.
    4. ``reward_running_norm``: update the run's moments with R, then ``R = (R - mean) / std`` (or ``R / std``).
    5. ``reward_clip``: ``R = clamp(R, -c, c)``; ``reward_clip_frac`` = rows changed.
    6. ``r_t = -beta * kl_t + [t = last] * R`` with the run's beta (0 in the reward with ``use_kl_loss``).
    7. ``advantages, returns = estimator.advantages(r, values, gamma, lambd)``.
    8. ``advantages_norm`` (whitening over ``action_mask``), then ``advantage_clip``.
    9. The run's beta is updated from this batch's mean per-sequence KL (adaptive controller only).

    ``counted`` (B,) bool: the rows whose rewards (stage 4) and KL (stage 9) advance the run's state; None: all.
    A resumed stream regenerates groups whose lost copies the state already counted (fastexp's resumable
    streams): those rows are shaped with the state as it stands and leave it unchanged.
    10. Rollout/trainer mismatch: truncated importance weights (``rollout_correction``) and the batch's mismatch
        metrics (:mod:`~fastexp.rl.rollout_correction`).

    γ and λ come from ``config`` for every batch (the seed pops γ inside its loop, so only its first micro-batch
    gets the requested value).

    Shape:
        rollout rows: B >= G * n, grouped by prompt (its n samples in order, a split episode's rows consecutive).
        reward: (B,) float32; forward tensors: (B, A) float32.

    Returns:
        ``(experience, state after this batch)``.

    Raises:
        ValueError: the episodes are not whole groups of ``n_samples_per_prompt``; split episodes with an estimator
            whose token stage groups rows (``cpgd``); ``gae`` without ``forward.values``.
    """
    n = config.n_samples_per_prompt
    batch = reward.shape[0]
    episodes = episode_ids(rollout.prompt_index, rollout.sample_index)
    count = int(episodes[-1]) + 1 if batch else 0
    if count % n:
        raise ValueError(f"{count} episodes are not whole groups of {n}")
    if count != batch and config.estimator.groups_rows:
        raise ValueError(f"{config.estimator.name} groups rows by n: it takes one row per episode")
    mask = rollout.action_mask
    kl = None  # no reference: the request has no KL anywhere (the service's ``ExperienceConfig.needs_reference``)
    if forward.base_action_log_probs is not None:
        kl = compute_approx_kl(forward.action_log_probs, forward.base_action_log_probs, mask, config.kl.kl_estimator)
    counted = torch.ones(batch, dtype=torch.bool) if counted is None else counted
    shaped = _shape_rewards(reward.float(), rollout.response_length, episodes, count, config, state, counted)
    kl_coef = state.kl.value
    in_reward = 0.0 if config.kl.use_kl_loss or kl is None else kl_coef
    per_token_rewards = compute_reward(shaped.reward, in_reward, torch.zeros(mask.shape) if kl is None else kl, mask)
    advantages, returns = config.estimator.advantages(
        TokenInputs(per_token_rewards, mask, forward.values, n, config.gamma, config.lambd)
    )
    if config.advantage.advantages_norm:
        advantages = whiten(advantages, mask)
    advantages, advantage_clip_frac = clip_with_fraction(advantages, config.advantage.advantage_clip, mask)

    next_state = RunState(reward_moments=shaped.moments, kl=_next_kl(state, kl, mask, counted))
    mismatch = rollout_correction(forward.action_log_probs, rollout.rollout_log_probs, mask, config.rollout_correction)
    rows = {name: getattr(rollout, name) for name in _FROM_ROLLOUT}
    experience = Experience(
        **rows,
        **_masked_forward(forward, mask),
        returns=returns,
        advantages=advantages,
        kl=kl,
        reward=reward.float(),
        reward_metrics=reward_metrics,
        kl_coef=kl_coef,
        batch_index=batch_index,
        shaped_reward=shaped.reward,
        reward_clip_frac=shaped.clip_frac,
        advantage_clip_frac=advantage_clip_frac,
        reward_norm_mean=shaped.norm_mean,
        reward_norm_std=shaped.norm_std,
        dropped_prompt_indices=dropped_prompt_indices,
        rollout_is_weights=mismatch.weights,
        rollout_log_prob_abs_diff=mismatch.log_prob_abs_diff,
        rollout_kl=mismatch.kl,
        rollout_is_clip_frac=mismatch.clip_frac,
    )
    return experience, next_state


def _next_kl(state: RunState, kl: torch.Tensor | None, mask: torch.Tensor, counted: torch.Tensor) -> KLController:
    """Stage 9: beta after the batch, from the mean per-sequence KL of its ``counted`` rows (unchanged without a
    reference or without counted rows)."""
    rows = int(counted.sum())
    if kl is None or not rows:
        return state.kl
    return state.kl.update(sequence_mean_kl(kl[counted], mask[counted]), rows)


#: Experience fields copied from the Rollout as they are.
_FROM_ROLLOUT = (
    "sequences", "attention_mask", "action_mask", "response_length", "total_length", "prompt_index", "sample_index",
    "prompt_texts", "response_texts", "policy_version", "rollout_log_probs", "vision", "repaired_vision_tokens",
    "num_turns",
)


class _ShapedRewards(NamedTuple):
    """Sequence-level rewards after stages 2-5: ``reward`` (B,) float32, the run's updated moments, the
    normalization statistics used (0 and 1 when off) and the fraction of rows ``reward_clip`` changed."""

    reward: torch.Tensor
    moments: RunningMoments
    norm_mean: float
    norm_std: float
    clip_frac: float


def _shape_rewards(
    reward: torch.Tensor, response_length: torch.Tensor, episodes: torch.Tensor, count: int, config: EstimateConfig,
    state: RunState, counted: torch.Tensor,
) -> _ShapedRewards:
    """Stages 2-5 of :func:`estimate_experience` over the ``count`` episodes of (B,) rows (``episodes``: each
    row's episode; ``counted``: the rows whose rewards advance the moments); the shaped reward comes back per row."""
    first = torch.ones_like(episodes, dtype=torch.bool)
    first[1:] = episodes[1:] != episodes[:-1]
    shaped = _shape_episode_rewards(
        reward[first], torch.zeros(count, dtype=response_length.dtype).index_add_(0, episodes, response_length),
        config, state, counted[first],
    )
    return shaped._replace(reward=shaped.reward[episodes])


def _shape_episode_rewards(
    reward: torch.Tensor, response_length: torch.Tensor, config: EstimateConfig, state: RunState,
    counted: torch.Tensor,
) -> _ShapedRewards:
    """Stages 2-5 over (E,) episode rewards, E = G * n (``counted`` (E,): those that advance the moments)."""
    options, batch, n = config.reward, reward.shape[0], config.n_samples_per_prompt
    if options.overlong_buffer_len > 0:
        reward = reward + overlong_penalty(
            response_length, options.max_new_tokens, options.overlong_buffer_len,
            options.overlong_buffer_penalty_factor,
        )
    reward = config.estimator.shape_rewards(reward.view(batch // n, n)).reshape(batch)
    moments, norm_mean, norm_std = state.reward_moments, 0.0, 1.0
    if options.reward_running_norm:
        moments = moments.update(reward[counted])
        reward, norm_mean, norm_std = running_normalize(reward, moments, options.reward_running_norm_minus_mean)
    reward, clip_frac = clip_with_fraction(reward, options.reward_clip)
    return _ShapedRewards(reward, moments, norm_mean, norm_std, clip_frac)


def _masked_forward(forward: ForwardOutputs, mask: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The forward outputs as Experience fields: each in its layout dtype, 0 on padding (absent ones None)."""
    return {
        name: None if value is None else value.to(EXPERIENCE_LAYOUT[name].dtype) * mask
        for name, value in zip(ForwardOutputs._fields, forward, strict=True)
    }

"""From rewards and log-probs to the final Experience: KL, reward shaping, returns, advantages (pure)."""

from __future__ import annotations

import torch

from services.experience.kl import compute_approx_kl
from services.experience.request import ExperienceConfig
from services.experience.rewards import compute_reward, discounted_returns
from services.experience.types import Experience, Rollout


def estimate_experience(
    rollout: Rollout,
    reward: torch.Tensor,
    reward_metrics: dict[str, torch.Tensor],
    action_log_probs: torch.Tensor,
    base_action_log_probs: torch.Tensor,
    config: ExperienceConfig,
    batch_index: int,
) -> Experience:
    """Compute KL, per-token rewards, returns and advantages for whole prompt groups.

    Steps (the seed's ``compute_advantages_and_returns`` for outcome-reward estimators):
    ``kl = compute_approx_kl(...)``; ``r' = estimator(reward grouped as (G, n))``;
    ``r_t = -beta * kl_t + [t = last] * r'`` (``beta = 0`` in the reward when ``use_kl_loss``);
    ``returns = discounted_returns(r, gamma)``; ``advantages = returns``.

    Shape:
        rollout rows: B = G * n, grouped by prompt (n consecutive rows per prompt, sample order).
        reward: (B,) float32; action_log_probs, base_action_log_probs: (B, A) float32.

    Raises:
        ValueError: B is not a multiple of ``config.n_samples_per_prompt``.
    """
    n = config.n_samples_per_prompt
    batch = reward.shape[0]
    if batch % n:
        raise ValueError(f"{batch} rows are not whole groups of {n}")
    mask = rollout.action_mask
    kl = compute_approx_kl(action_log_probs, base_action_log_probs, mask, config.kl_estimator)
    shaped = config.estimator.shape_rewards(reward.view(batch // n, n)).reshape(batch)
    kl_coef_in_reward = 0.0 if config.use_kl_loss else config.kl_coef
    per_token_rewards = compute_reward(shaped, kl_coef_in_reward, kl, mask)
    returns = discounted_returns(per_token_rewards, mask, config.gamma)
    return Experience(
        sequences=rollout.sequences,
        attention_mask=rollout.attention_mask,
        action_mask=mask,
        action_log_probs=action_log_probs * mask,
        base_action_log_probs=base_action_log_probs * mask,
        values=None,
        returns=returns,
        advantages=returns.clone(),
        kl=kl,
        reward=reward.float(),
        response_length=rollout.response_length,
        total_length=rollout.total_length,
        prompt_index=rollout.prompt_index,
        sample_index=rollout.sample_index,
        prompt_texts=rollout.prompt_texts,
        response_texts=rollout.response_texts,
        policy_version=rollout.policy_version,
        reward_metrics=reward_metrics,
        kl_coef=config.kl_coef,
        batch_index=batch_index,
        rollout_log_probs=rollout.rollout_log_probs,
    )

"""Per-token rewards and discounted returns (OpenRLHF/LightRFT ``compute_reward``, ``get_cumulative_returns``)."""

from __future__ import annotations

import torch


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last true position per row, (B, A) bool -> (B,) int64; 0 for an all-false row."""
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)
    return torch.where(action_mask, positions, 0).amax(dim=1)


def compute_reward(
    reward: torch.Tensor, kl_coef: float, kl: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token reward: the KL penalty on every token and the scalar reward on the last response token.

    ``r_t = -kl_coef * kl_t + [t == last(action_mask)] * reward`` (Ouyang et al. 2022, InstructGPT eq. 2; the
    seed's ``compute_reward``). Padding positions get 0 because ``kl`` is 0 there.

    Shape:
        reward: (B,) scalar rewards (after any shaping, e.g. group normalization).
        kl: (B, A) per-token KL (0 where ``action_mask`` is false).
        action_mask: (B, A) bool.
        returns: (B, A) float32.
    """
    per_token = -kl_coef * kl.float()
    last = last_action_index(action_mask).unsqueeze(1)
    return per_token.scatter_add(1, last, reward.float().unsqueeze(1) * action_mask.any(dim=1, keepdim=True))


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the response, 0 on padding.

    Padding sits to the right of each response, so it never contributes (its reward is masked to 0).

    Shape:
        rewards: (B, A) per-token rewards; action_mask: (B, A) bool; returns: (B, A) float32.
    """
    rewards = rewards.float() * action_mask
    if gamma == 1.0:
        return rewards.flip(1).cumsum(1).flip(1) * action_mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * action_mask

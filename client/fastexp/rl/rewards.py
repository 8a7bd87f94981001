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


def discounted_reverse_cumsum(x: torch.Tensor, discount: float, block: int = 64) -> torch.Tensor:
    """``y_t = sum_{k >= t} discount^(k - t) * x_k`` along the last dimension, without a per-timestep loop.

    A blocked scan: within each block of ``block`` steps a (block, block) upper-triangular Toeplitz matrix of
    powers ``discount^(k - t)`` does the sum as one matmul; a loop over the ``T / block`` blocks carries
    ``discount^(block - t) * y_(start of next block)`` backwards. Equal to :func:`discounted_reverse_cumsum_loop` up
    to float rounding (the benchmark reports the difference), with powers never above 1 (``0 <= discount <= 1``).

    Shape:
        x: (B, T) float; returns (B, T) in x's dtype.
    """
    batch, length = x.shape
    pad = (-length) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(batch, -1, block)
    index = torch.arange(block, device=x.device)
    exponent = (index[None, :] - index[:, None]).to(x.dtype)  # [t, k] = k - t
    base = torch.tensor(discount, dtype=x.dtype, device=x.device)
    powers = torch.where(exponent >= 0, base ** exponent.clamp(min=0), torch.zeros((), dtype=x.dtype))
    out = blocks @ powers.T  # out[b, j, t] = sum_{k >= t in block j} discount^(k - t) * x[b, j, k]
    decay = base ** (block - index).to(x.dtype)  # discount^(block - t)
    carry = torch.zeros(batch, 1, dtype=x.dtype, device=x.device)
    for j in reversed(range(out.shape[1])):
        out[:, j] += decay * carry
        carry = out[:, j, :1]
    return out.reshape(batch, -1)[:, :length]


def discounted_reverse_cumsum_loop(x: torch.Tensor, discount: float) -> torch.Tensor:
    """Reference for :func:`discounted_reverse_cumsum`: ``y_t = x_t + discount * y_(t+1)``, one step at a time."""
    out = torch.empty_like(x)
    running = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    for t in reversed(range(x.shape[1])):
        running = x[:, t] + discount * running
        out[:, t] = running
    return out


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the response, 0 on padding.

    Padding sits to the right of each response, so it never contributes (its reward is masked to 0).

    Shape:
        rewards: (B, A) per-token rewards; action_mask: (B, A) bool; returns: (B, A) float32.
    """
    rewards = rewards.float() * action_mask
    return discounted_reverse_cumsum(rewards, gamma) * action_mask


def gae_loop(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference GAE, one timestep at a time, as in OpenRLHF's ``get_advantages_and_returns``.

    See :func:`gae` for the definition; this is the loop it is tested and benchmarked against.
    """
    values = values.float() * action_mask
    rewards = rewards.float() * action_mask
    last = torch.zeros(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    advantages = torch.empty_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lambd * last
        advantages[:, t] = last
    return advantages * action_mask, (advantages + values) * action_mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438), vectorized.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` = 0 past the response (values and rewards are masked, and
    responses are right-padded); ``A_t = sum_{k >= t} (gamma * lambd)^(k - t) * delta_k``; ``returns = A + V``.
    Both outputs are 0 where ``action_mask`` is false.

    Shape:
        rewards, values: (B, A) float; action_mask: (B, A) bool; returns ``(advantages, returns)``, each (B, A)
        float32.
    """
    values = values.float() * action_mask
    deltas = rewards.float() * action_mask - values  # r_t - V_t
    deltas[:, :-1].add_(values[:, 1:], alpha=gamma)  # + gamma * V_{t+1}; V past the end is 0
    advantages = discounted_reverse_cumsum(deltas, gamma * lambd).mul_(action_mask)
    return advantages, advantages + values

"""Advantage estimators: a registry of pure functions over prompt groups, selected by name in the request.

Every estimator here is outcome-based: it maps the scalar rewards of a group of ``n = n_samples_per_prompt``
samples of one prompt to shaped scalar rewards. The shaped reward then goes through :func:`compute_reward`
(adding the per-token KL penalty) and :func:`discounted_returns`; as in OpenRLHF/LightRFT,
``advantages = returns`` for these estimators (no critic).

Notation: ``r`` is (G, n), G prompt groups of n samples; ``mean``/``std`` are per group (row).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: ε added to the std in group normalization (the seed's value).
GROUP_NORM_EPS = 1e-9


def reinforce(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE (Williams 1992): rewards unchanged. (G, n) -> (G, n)."""
    return rewards.float()


def reinforce_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the group mean as baseline: ``r - mean(r)``. (G, n) -> (G, n)."""
    rewards = rewards.float()
    return rewards - rewards.mean(dim=1, keepdim=True)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): ``r - mean(r)``.

    GRPO without the division by the group std, which biases updates toward groups of low reward variance.
    Needs ``n >= 2`` (a single sample would always get 0). (G, n) -> (G, n).
    """
    rewards = rewards.float()
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740): ``r_i - mean_{j != i} r_j``.

    ``= r_i - (sum(r) - r_i) / (n - 1)``; needs ``n >= 2``. (G, n) -> (G, n).
    """
    rewards = rewards.float()
    n = rewards.shape[1]
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - baseline


def group_norm(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO group normalization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

    ``(r - mean(r)) / (std(r) + eps)`` with the **unbiased** (n - 1) std, as torch's default and the seed, and
    ``eps = 1e-9``; a group whose rewards are all equal gets zeros. Needs ``n >= 2``. (G, n) -> (G, n).
    """
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + GROUP_NORM_EPS)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and the smallest group it is defined for."""

    name: str
    shape_rewards: Callable[[torch.Tensor], torch.Tensor]
    min_samples_per_prompt: int
    why_min: str = ""


ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in (
        AdvantageEstimator("group_norm", group_norm, 2, "the group std is undefined for one sample"),
        AdvantageEstimator("dr_grpo", dr_grpo, 2, "the group mean of one sample is the sample itself"),
        AdvantageEstimator("rloo", rloo, 2, "the leave-one-out baseline needs another sample of the prompt"),
        AdvantageEstimator("reinforce", reinforce, 1),
        AdvantageEstimator("reinforce_baseline", reinforce_baseline, 1),
    )
}
ALIASES: dict[str, str] = {"grpo": "group_norm"}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name`` or an alias of it.

    Raises:
        KeyError: no such estimator.
    """
    return ESTIMATORS[ALIASES.get(name, name)]

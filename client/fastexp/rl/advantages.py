"""Advantage estimators: a registry of pure functions, selected by name in the request.

An estimator has two stages, as in the seed (LightRFT ``FastExperienceMaker``):

1. ``shape_rewards``: scalar rewards of G prompt groups of ``n = n_samples_per_prompt`` samples, (G, n) -> (G, n).
   The outcome estimators (GRPO, RLOO, ...) put their baseline here.
2. ``advantages``: per-token rewards ``r_t`` (the shaped scalar at the last response token plus the KL penalty,
   see :func:`fastexp.rl.rewards.compute_reward`) -> ``(advantages, returns)``, each (B, A), B = G * n
   rows grouped by prompt. Outcome estimators use ``returns = advantages = sum_{k>=t} gamma^(k-t) r_k``; GAE uses
   the critic's values; CPGD normalizes whole-sequence returns per group.

Conventions (stated, not implied): group statistics are per prompt group (a row of the (G, n) view); "std" is
the unbiased (n - 1) std unless a docstring says population std; every output is 0 where ``action_mask`` is false.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastexp.rl.rewards import discounted_returns, gae

#: ε added to the group std in ``group_norm`` (the seed's value; the reward is float32, where 1e-9 is representable).
GROUP_NORM_EPS = 1e-9
#: ε added to the population std in ``cpgd`` (the seed's ``get_cpgd_advantages_returns`` default).
CPGD_EPS = 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: group shaping of scalar rewards, (G, n) -> (G, n)
# ---------------------------------------------------------------------------------------------------------------


def identity(rewards: torch.Tensor) -> torch.Tensor:
    """No baseline (REINFORCE, Williams 1992; and the critic/CPGD estimators, which act per token). (G, n)."""
    return rewards.float()


def mean_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """``r - mean_g(r)``: REINFORCE with the group mean as baseline, and Dr. GRPO (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783: GRPO without the std division, which biases updates
    toward low-variance groups). A group of one gets 0. (G, n) -> (G, n)."""
    rewards = rewards.float()
    return rewards - rewards.mean(dim=1, keepdim=True)


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019): ``r_i - mean_{j != i} r_j``.

    ``= r_i - (sum_g(r) - r_i) / (n - 1)``: the baseline excludes the sample itself. Needs ``n >= 2``.
    (G, n) -> (G, n).
    """
    rewards = rewards.float()
    n = rewards.shape[1]
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)
    return rewards - baseline


def group_normalize(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO group normalization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300).

    ``(r - mean_g(r)) / (std_g(r) + 1e-9)`` with the **unbiased** (n - 1) std, as torch's default and the seed;
    a group whose rewards are all equal gets zeros. Needs ``n >= 2``. (G, n) -> (G, n).
    """
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + GROUP_NORM_EPS)


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: per-token advantages and returns, (B, A) -> ((B, A), (B, A))
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenInputs:
    """What stage 2 reads. ``token_rewards``, ``action_mask``: (B, A); ``values``: (B, A) or None; B = G * n."""

    token_rewards: torch.Tensor
    action_mask: torch.Tensor
    values: torch.Tensor | None
    n_samples_per_prompt: int
    gamma: float
    lambd: float


def discounted_return_advantages(inputs: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``returns_t = sum_{k>=t} gamma^(k-t) r_k`` and ``advantages = returns`` (the seed's
    ``get_cumulative_returns`` path for reinforce/rloo/reinforce_baseline/group_norm)."""
    returns = discounted_returns(inputs.token_rewards, inputs.action_mask, inputs.gamma)
    return returns.clone(), returns


def gae_advantages(inputs: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, arXiv 1506.02438) with the request's gamma and lambd, see :func:`gae`.

    Raises:
        ValueError: ``values`` is None (request validation rejects ``gae`` without a critic first).
    """
    if inputs.values is None:
        raise ValueError("gae needs values from a critic")
    return gae(inputs.token_rewards, inputs.values, inputs.action_mask, inputs.gamma, inputs.lambd)


def cpgd_advantages(inputs: TokenInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """CPGD (Liu et al. 2025, "CPGD: Toward Stable Rule-based RL for Language Models", arXiv 2505.12504).

    ``s_i = sum_t r_t`` (scalar reward plus the KL penalty), ``A_i = (s_i - mean_g(s)) / (pop_std_g(s) + 1e-6)``
    broadcast over the row's response tokens; ``returns = advantages``. Population (biased) std and ε = 1e-6 as
    the seed's ``get_cpgd_advantages_returns`` (its "STD_weight"). The seed normalizes over its whole
    micro-batch, which equals a prompt group only when ``micro_rollout_batch_size == n``; here it is always the
    prompt group, as the method's group-wise normalization intends.
    """
    mask = inputs.action_mask
    n = inputs.n_samples_per_prompt
    scores = (inputs.token_rewards.float() * mask).sum(dim=1).view(-1, n)
    mean = scores.mean(dim=1, keepdim=True)
    std = scores.std(dim=1, keepdim=True, unbiased=False)
    normalized = ((scores - mean) / (std + CPGD_EPS)).reshape(-1, 1)
    advantages = normalized * mask
    return advantages, advantages.clone()


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its two stages, what it needs, and its documentation for the README table."""

    name: str
    shape_rewards: Callable[[torch.Tensor], torch.Tensor]
    advantages: Callable[[TokenInputs], tuple[torch.Tensor, torch.Tensor]]
    min_samples_per_prompt: int
    needs_critic: bool
    formula: str
    source: str
    why_min: str = ""
    groups_rows: bool = False  # its token stage views rows as (G, n): it takes one row per episode


ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in (
        AdvantageEstimator(
            "gae", identity, gae_advantages, 1, True,
            "δ_t = r_t + γV_{t+1} − V_t; A_t = Σ_k (γλ)^(k−t) δ_k; returns = A + V",
            "Schulman et al. 2016, arXiv 1506.02438",
        ),
        AdvantageEstimator(
            "reinforce", identity, discounted_return_advantages, 1, False,
            "A_t = returns_t = Σ_{k≥t} γ^(k−t) r_k",
            "Williams 1992; REINFORCE++ (Hu 2025, arXiv 2501.03262)",
        ),
        AdvantageEstimator(
            "reinforce_baseline", mean_baseline, discounted_return_advantages, 1, False,
            "R'_i = R_i − mean_g(R); A_t = Σ_{k≥t} γ^(k−t) r_k",
            "REINFORCE++-baseline (Hu 2025, arXiv 2501.03262)",
        ),
        AdvantageEstimator(
            "rloo", leave_one_out, discounted_return_advantages, 2, False,
            "R'_i = R_i − (Σ_g R − R_i)/(n − 1); A_t = Σ_{k≥t} γ^(k−t) r_k",
            "Ahmadian et al. 2024, arXiv 2402.14740",
            "the leave-one-out baseline needs another sample of the prompt",
        ),
        AdvantageEstimator(
            "group_norm", group_normalize, discounted_return_advantages, 2, False,
            "R'_i = (R_i − mean_g R)/(std_g R + 1e-9), unbiased std; A_t = Σ_{k≥t} γ^(k−t) r_k",
            "GRPO, Shao et al. 2024, arXiv 2402.03300",
            "the group std is undefined for one sample",
        ),
        AdvantageEstimator(
            "dr_grpo", mean_baseline, discounted_return_advantages, 2, False,
            "R'_i = R_i − mean_g R; A_t = Σ_{k≥t} γ^(k−t) r_k",
            "Dr. GRPO, Liu et al. 2025, arXiv 2503.20783",
            "the group mean of one sample is the sample itself",
        ),
        AdvantageEstimator(
            "cpgd", identity, cpgd_advantages, 2, False,
            "s_i = Σ_t r_t; A_t = returns_t = (s_i − mean_g s)/(pop_std_g s + 1e-6)",
            "Liu et al. 2025, arXiv 2505.12504",
            "the group statistics need more than one sample", groups_rows=True,
        ),
    )
}
ALIASES: dict[str, str] = {"grpo": "group_norm"}


def get_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name`` or an alias of it.

    Raises:
        KeyError: no such estimator.
    """
    return ESTIMATORS[ALIASES.get(name, name)]

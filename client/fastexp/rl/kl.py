"""Per-token KL estimators between the actor and the reference policy.

Notation: ``log_ratio_t = action_log_probs_t - base_action_log_probs_t = log pi(a_t|s_t) - log pi_ref(a_t|s_t)``,
with actions sampled from the rollout policy. Estimators from J. Schulman, "Approximating KL Divergence" (2020),
as used by OpenRLHF/LightRFT ``compute_approx_kl``:

- ``k1``: ``log_ratio``                         (unbiased, high variance, can be negative)
- ``k2``: ``log_ratio**2 / 2``                  (biased, low variance, >= 0)
- ``k3``: ``exp(-log_ratio) - 1 + log_ratio``   (unbiased for KL(pi || pi_ref), >= 0)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor], torch.Tensor]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.square() / 2


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": _k1, "k2": _k2, "k3": _k3}


def compute_approx_kl(
    action_log_probs: torch.Tensor,
    base_action_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-token KL estimate, zero where ``action_mask`` is false.

    Shape:
        action_log_probs, base_action_log_probs: (B, A) log-probs in nats (float).
        action_mask: (B, A) bool.
        returns: (B, A) float32, nats.

    Raises:
        KeyError: unknown ``estimator`` (callers validate names against ``KL_ESTIMATORS`` first).
    """
    log_ratio = action_log_probs.float() - base_action_log_probs.float()
    return KL_ESTIMATORS[estimator](log_ratio) * action_mask

"""Rollout/trainer mismatch: truncated importance weights and the batch's mismatch metrics (pure).

The generator samples with its own kernels (vLLM bf16) and, off-policy, with older weights; the actor forward here
recomputes the sampled tokens' log-probs as the trainer would. The policy gradient is an expectation under the
actor, the samples came from the rollout policy, so each sampled token is re-weighted by ``π_actor / π_rollout``,
truncated at ``C`` to bound the variance: truncated importance sampling (TIS), Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training" (fengyao.notion.site/off-policy-rl); verl's rollout
correction (``rollout_is``), OpenRLHF's ``tis``, slime's ``--use-tis``.

Notation, per row i and response position t, on ``action_mask`` only:
``Δ_t = action_log_probs_t − rollout_log_probs_t = log π_actor(a_t|s_t) − log π_rollout(a_t|s_t)`` (nats).

- token level:    ``w_t = min(exp(Δ_t), C)``
- sequence level: ``w_i = min(exp(Σ_t Δ_t), C)``, the same weight at every action position of the row
- ``rollout_log_prob_abs_diff = mean_t |Δ_t|`` over the batch's action tokens (nats)
- ``rollout_kl = mean_t (exp(Δ_t) − 1 − Δ_t)``: Schulman's k3 estimate of KL(π_rollout ‖ π_actor) from the rollout's
  own samples (unbiased, ≥ 0; nats per token)
- ``rollout_is_clip_frac``: the share of action tokens (token level) or of rows (sequence level) whose weight the
  truncation changed (``exp(Δ) > C``); 0 with the correction off.

The weights are computed in log space (``exp(min(Δ, log C))``), so a long row's summed ratio never overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

#: The truncation C when the request leaves it unset (verl's ``rollout_is_threshold`` default; TIS uses 2).
DEFAULT_THRESHOLD = 2.0

Level = Literal["token", "sequence"]


@dataclass(frozen=True)
class RolloutCorrectionOptions:
    """Truncated importance weights at ``level`` ("token" or "sequence"), truncated at ``threshold`` (C ≥ 1)."""

    level: Level
    threshold: float = DEFAULT_THRESHOLD


class RolloutMismatch(NamedTuple):
    """What :func:`rollout_correction` returns (see the module docstring for the formulas)."""

    weights: torch.Tensor | None  # (B, A) float32, 0 off action_mask; None with the correction off
    log_prob_abs_diff: float  # nats per action token
    kl: float  # nats per action token, k3
    clip_frac: float  # share of tokens (token level) or rows (sequence level) truncated


def rollout_correction(
    action_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    options: RolloutCorrectionOptions | None,
) -> RolloutMismatch:
    """Truncated importance weights (``options`` None: none) and the mismatch metrics of one batch.

    Shape:
        action_log_probs, rollout_log_probs: (B, A) float log-probs (nats); action_mask: (B, A) bool.

    A batch without action tokens has metrics 0.
    """
    mask = action_mask.bool()
    delta = (action_log_probs.float() - rollout_log_probs.float()) * mask
    tokens = int(mask.sum())
    abs_diff = float(delta.abs().sum()) / tokens if tokens else 0.0
    kl = float((torch.expm1(delta) - delta).sum()) / tokens if tokens else 0.0  # 0 off the mask: expm1(0) - 0
    if options is None:
        return RolloutMismatch(None, abs_diff, kl, 0.0)
    log_threshold = math.log(options.threshold)
    if options.level == "token":
        clipped = (delta > log_threshold) & mask
        weights = torch.exp(delta.clamp(max=log_threshold)) * mask
        clip_frac = float(clipped.sum()) / tokens if tokens else 0.0
    else:
        row_log_ratio = delta.sum(dim=1, keepdim=True)  # (B, 1)
        weights = torch.exp(row_log_ratio.clamp(max=log_threshold)).expand_as(delta) * mask
        rows = mask.any(dim=1)
        clip_frac = float(((row_log_ratio.squeeze(1) > log_threshold) & rows).sum()) / max(int(rows.sum()), 1)
    return RolloutMismatch(weights.float(), abs_diff, kl, clip_frac)

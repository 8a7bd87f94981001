"""Reward and advantage post-processing options of the seed, as pure functions (each stage one function).

Order in :func:`fastexp.rl.estimate.estimate_experience`: :func:`overlong_penalty` is added to the
scorer's reward, the estimator shapes it per group, :func:`running_normalize` and :func:`clip_with_fraction`
follow; after the advantages: :func:`whiten` and :func:`clip_with_fraction` again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastexp.rl.running import RunningMoments

#: ε added to the std in advantage whitening (the seed's ``advantages_norm``); std is the unbiased one.
WHITEN_EPS = 1e-9


def overlong_penalty(
    response_length: torch.Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13; the seed's ``overlong_buffer``).

    ``penalty = min(0, -(len - (max_new_tokens - buffer_len)) / buffer_len * penalty_factor)``: 0 up to
    ``max_new_tokens - buffer_len`` tokens, then linear down to ``-penalty_factor`` at ``max_new_tokens``.

    Shape:
        response_length: (B,) int tokens; returns (B,) float32, <= 0.
    """
    expected = max_new_tokens - buffer_len
    excess = response_length.float() - expected
    return torch.clamp(-excess / buffer_len * penalty_factor, max=0.0)


def running_normalize(
    rewards: torch.Tensor, moments: RunningMoments, minus_mean: bool
) -> tuple[torch.Tensor, float, float]:
    """``(r - mean) / scale`` (``minus_mean``) or ``r / scale`` with a run's moments *after* this batch's update.

    ``scale`` is :meth:`RunningMoments.scale` (the unbiased running std, or 1 while it is below 1e-6). The moments
    include the current batch, as in the seed (update, then normalize).

    Returns:
        ``(normalized (B,) float32, mean used, scale used)``; the mean is 0.0 when not subtracted.
    """
    mean = moments.mean if minus_mean else 0.0
    scale = moments.scale()
    return ((rewards.double() - mean) / scale).float(), mean, scale


def clip_with_fraction(values: torch.Tensor, bound: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Clamp to ``[-bound, bound]`` and report the fraction of elements the clamp changed.

    The fraction counts ``|x| > bound`` **before** clamping, over ``mask`` when given (the seed's GAE path counts
    after clamping and so always reports 0). ``bound = 0`` means off: values unchanged, fraction 0.

    Shape:
        values: any shape; mask: same shape bool or None. Returns ``(clamped, fraction in [0, 1])``.
    """
    if bound <= 0:
        return values, 0.0
    outside = values.abs() > bound
    if mask is not None:
        outside = outside & mask
        total = int(mask.sum())
    else:
        total = values.numel()
    fraction = float(outside.sum()) / total if total else 0.0
    return values.clamp(-bound, bound), fraction


def whiten(advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Advantage whitening over a batch (the seed's ``advantages_norm``): ``(A - mean) / (std + 1e-9)``.

    Mean and **unbiased** std over the positions where ``action_mask`` is true; masked positions stay 0 (the
    seed leaves ``-mean / std`` there). With fewer than two action tokens the advantages are only centered.

    Shape:
        advantages: (B, A) float; action_mask: (B, A) bool; returns (B, A) float32.
    """
    selected = advantages.float()[action_mask]
    if selected.numel() == 0:
        return advantages.float() * action_mask
    mean = selected.mean()
    std = selected.std(unbiased=True) if selected.numel() > 1 else torch.zeros(())
    return (advantages.float() - mean) / (std + WHITEN_EPS) * action_mask


def sequence_mean_kl(kl: torch.Tensor, action_mask: torch.Tensor) -> float:
    """Mean over rows of each row's mean KL over its response tokens (OpenRLHF's ``status["kl"]``), nats.

    Rows without response tokens are left out; 0.0 when there are none.
    """
    counts = action_mask.sum(dim=1)
    has_actions = counts > 0
    if not bool(has_actions.any()):
        return 0.0
    per_row = (kl.float() * action_mask).sum(dim=1)[has_actions] / counts[has_actions]
    return float(per_row.mean())


def zero_variance_groups(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Dynamic sampling's filter (DAPO, Yu et al. 2025): which prompt groups have all-equal rewards.

    Such a group gives every sample the same reward, so group-baseline estimators assign it zero advantage; the
    seed masks them only for all-0 or all-1 rewards, this tests exact equality of all rewards in the group.

    Shape:
        rewards: (G * n,) float; returns (G,) bool.
    """
    grouped = rewards.view(-1, n_samples_per_prompt)
    return (grouped == grouped[:, :1]).all(dim=1)


def episode_ids(prompt_index: Sequence[int], sample_index: Sequence[int]) -> torch.Tensor:
    """Each row's episode: consecutive rows with the same (prompt, sample) are one episode (an agent episode the
    agent's framework rewrote is split into such rows; every other row is an episode of its own).

    Shape:
        prompt_index, sample_index: (B,); returns (B,) int64, episode numbers 0..E-1 in row order.
    """
    pairs = torch.tensor([list(prompt_index), list(sample_index)], dtype=torch.int64)
    starts = torch.ones(pairs.shape[1], dtype=torch.int64)
    starts[1:] = (pairs[:, 1:] != pairs[:, :-1]).any(dim=0).long()
    return starts.cumsum(0) - 1

"""Truncated importance weights and the rollout/trainer mismatch metrics, on hand-computed tensors and as
properties (client/fastexp/rl/rollout_correction.py; Yao et al. 2025 TIS)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastexp.rl.rollout_correction import RolloutCorrectionOptions, rollout_correction

# two rows; row 0 has 3 action tokens, row 1 has 2 (then padding)
MASK = torch.tensor([[True, True, True], [True, True, False]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]])
DELTA = torch.tensor([[0.2, -0.1, 1.0], [0.0, -0.4, 0.0]])  # action - rollout; 1.0 > log 2 is truncated at C = 2
ACTOR = ROLLOUT + DELTA + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 7.0]])  # padding differs: must not count


def test_token_level_weights_and_metrics_by_hand():
    result = rollout_correction(ACTOR, ROLLOUT, MASK, RolloutCorrectionOptions("token", 2.0))
    expected = torch.tensor([[math.exp(0.2), math.exp(-0.1), 2.0], [1.0, math.exp(-0.4), 0.0]])
    torch.testing.assert_close(result.weights, expected)
    assert result.weights.dtype == torch.float32
    assert math.isclose(result.log_prob_abs_diff, (0.2 + 0.1 + 1.0 + 0.0 + 0.4) / 5, rel_tol=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in (0.2, -0.1, 1.0, 0.0, -0.4)) / 5
    assert math.isclose(result.kl, k3, rel_tol=1e-5)
    assert result.clip_frac == 1 / 5  # one token of five truncated


def test_sequence_level_weight_is_the_rows_ratio_truncated():
    result = rollout_correction(ACTOR, ROLLOUT, MASK, RolloutCorrectionOptions("sequence", 2.0))
    row0, row1 = min(math.exp(0.2 - 0.1 + 1.0), 2.0), min(math.exp(-0.4), 2.0)
    torch.testing.assert_close(result.weights, torch.tensor([[row0] * 3, [row1, row1, 0.0]]))
    assert result.clip_frac == 1 / 2  # row 0 (exp(1.1) > 2) of two rows


def test_off_gives_metrics_only_and_a_huge_sequence_ratio_does_not_overflow():
    result = rollout_correction(ACTOR, ROLLOUT, MASK, None)
    assert result.weights is None and result.clip_frac == 0.0 and result.log_prob_abs_diff > 0
    long_mask = torch.ones(1, 4096, dtype=torch.bool)
    huge = rollout_correction(torch.zeros(1, 4096), torch.full((1, 4096), -1.0), long_mask,
                              RolloutCorrectionOptions("sequence", 3.0))
    assert torch.isfinite(huge.weights).all() and huge.weights.max() == 3.0 and huge.clip_frac == 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 7), st.floats(1.0, 10.0), st.sampled_from(["token", "sequence"]),
       st.integers(0, 2**31 - 1))
def test_weights_are_bounded_masked_and_exact_on_policy(rows, width, threshold, level, seed):
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, width, generator=generator) * 5
    actor = rollout + torch.randn(rows, width, generator=generator)
    mask = torch.rand(rows, width, generator=generator) > 0.3
    result = rollout_correction(actor, rollout, mask, RolloutCorrectionOptions(level, threshold))
    assert (result.weights[~mask] == 0).all()
    assert (result.weights[mask] > 0).all() and (result.weights <= threshold + 1e-5).all()
    assert result.kl >= -1e-6 and 0.0 <= result.clip_frac <= 1.0
    on_policy = rollout_correction(rollout, rollout, mask, RolloutCorrectionOptions(level, threshold))
    assert (on_policy.weights[mask] == 1).all() and on_policy.kl == 0 and on_policy.log_prob_abs_diff == 0

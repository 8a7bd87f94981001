"""GAE and the blocked discounted scan against the per-timestep loops they replace, and by hand."""

import pytest
import torch

from benchmarks import gae as gae_benchmark
from fastexp.rl.rewards import (
    discounted_reverse_cumsum,
    discounted_reverse_cumsum_loop,
    gae,
    gae_loop,
)


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("length", [1, 7, 64, 130])
def test_blocked_scan_matches_the_loop(discount, length):
    x = torch.randn(5, length, dtype=torch.float64)
    expected = discounted_reverse_cumsum_loop(x, discount)
    assert torch.allclose(discounted_reverse_cumsum(x, discount, block=16), expected, atol=1e-12)
    assert torch.allclose(discounted_reverse_cumsum(x, discount), expected, atol=1e-12)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[True, True, False]])
    # gamma = 0.5, lambda = 0.5; V past the response is 0 (position 2 is padding)
    # delta_1 = 1 + 0.5 * 0 - 0.25 = 0.75;  delta_0 = 0 + 0.5 * 0.25 - 0.5 = -0.375
    # A_1 = 0.75;  A_0 = -0.375 + 0.25 * 0.75 = -0.1875;  returns = A + V = [0.3125, 1.0]
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lambd=0.5)
    assert torch.allclose(advantages, torch.tensor([[-0.1875, 0.75, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.3125, 1.0, 0.0]]))


@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, 1.0)])
def test_vectorized_gae_matches_the_loop(gamma, lambd):
    rewards, values, mask = gae_benchmark.make_inputs(6, 300, seed=int(gamma * 100 + lambd * 10))
    expected = gae_loop(rewards, values, mask, gamma, lambd)
    actual = gae(rewards, values, mask, gamma, lambd)
    for a, e in zip(actual, expected, strict=True):
        assert torch.allclose(a, e, atol=1e-5)
        assert (a[~mask] == 0).all()


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rewards, _, mask = gae_benchmark.make_inputs(3, 50)
    advantages, returns = gae(rewards, torch.zeros_like(rewards), mask, gamma=0.9, lambd=1.0)
    expected = discounted_reverse_cumsum_loop(rewards * mask, 0.9) * mask
    assert torch.allclose(advantages, expected, atol=1e-5) and torch.allclose(returns, expected, atol=1e-5)


def test_benchmark_smoke():
    """The benchmark runs and reports its keys (tiny sizes; no speed threshold in tests)."""
    figures = gae_benchmark.run(batch=4, length=64, repeats=1)
    assert {"gae_vectorized_speedup", "gae_max_abs_error"} <= set(figures)
    assert figures["gae_max_abs_error"] < 1e-4

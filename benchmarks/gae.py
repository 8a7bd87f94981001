"""Vectorized GAE vs the per-timestep loop, on the same inputs in one run.

Figures: ``gae_vectorized_speedup`` = median loop time / median vectorized time, and ``gae_max_abs_error`` =
max |vectorized - loop| over all (B, A) entries (both float32). Inputs mimic LLM PPO: gamma 1, lambda 0.95, a
critic's values ~ N(0, 1), per-token rewards -beta * kl with a scalar reward on each response's last token, and
response lengths spread over [A/4, A].
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from fastexp.rl.rewards import compute_reward, gae, gae_loop


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def make_inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, values, action_mask), each (batch, length)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    kl = torch.randn(batch, length, generator=generator).abs() * 0.1 * mask
    scalar = torch.randint(0, 2, (batch,), generator=generator).float()
    rewards = compute_reward(scalar, 0.01, kl, mask)
    values = torch.randn(batch, length, generator=generator)
    return rewards, values, mask


def run(batch: int = 256, length: int = 4096, repeats: int = 9, gamma: float = 1.0, lambd: float = 0.95) -> dict:
    """Measure both implementations on the same inputs; returns the figures and the settings."""
    rewards, values, mask = make_inputs(batch, length)
    loop_s = _median_seconds(lambda: gae_loop(rewards, values, mask, gamma, lambd), repeats)
    vectorized_s = _median_seconds(lambda: gae(rewards, values, mask, gamma, lambd), repeats)
    reference, _ = gae_loop(rewards, values, mask, gamma, lambd)
    vectorized, _ = gae(rewards, values, mask, gamma, lambd)
    return {
        "gae_vectorized_speedup": loop_s / vectorized_s,
        "gae_max_abs_error": float((vectorized - reference).abs().max()),
        "gae_loop_s": loop_s,
        "gae_vectorized_s": vectorized_s,
        "gae_shape": [batch, length],
        "gae_gamma_lambda": [gamma, lambd],
    }

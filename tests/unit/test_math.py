"""Experience math on tiny hand-computed tensors; each expected value is derived in a comment."""

import math

import pytest
import torch

from services.experience.advantages import (
    dr_grpo,
    get_estimator,
    group_norm,
    reinforce,
    reinforce_baseline,
    rloo,
)
from services.experience.estimate import estimate_experience
from services.experience.kl import compute_approx_kl
from services.experience.request import ExperienceConfig
from services.experience.rewards import (
    compute_reward,
    discounted_returns,
    discounted_reverse_cumsum_loop,
    last_action_index,
)
from services.experience.types import Rollout

MASK = torch.tensor([[True, True, False]])


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0, -5.0]])
    base = torch.tensor([[-1.5, -1.0, -1.0]])
    # log_ratio = [0.5, -1.0, (masked)]
    assert torch.allclose(compute_approx_kl(logp, base, MASK, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    # k2 = log_ratio^2 / 2 = [0.125, 0.5]
    assert torch.allclose(compute_approx_kl(logp, base, MASK, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))
    # k3 = exp(-x) - 1 + x: x=0.5 -> e^-0.5 - 0.5; x=-1 -> e^1 - 2
    k3 = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert torch.allclose(compute_approx_kl(logp, base, MASK, "k3"), k3)


def test_last_action_index():
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    assert last_action_index(mask).tolist() == [1, 2, 0]


def test_compute_reward_puts_scalar_on_last_token_and_penalises_kl():
    kl = torch.tensor([[0.5, -1.0, 0.0]])
    # r_t = -0.1 * kl_t, plus 2.0 on the last valid token (index 1): [-0.05, 0.1 + 2.0, 0]
    rewards = compute_reward(torch.tensor([2.0]), 0.1, kl, MASK)
    assert torch.allclose(rewards, torch.tensor([[-0.05, 2.1, 0.0]]))


def test_discounted_returns_by_hand_and_against_gamma_one():
    rewards = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[True, True, True, False]])
    # gamma = 0.5: G2 = 4; G1 = 2 + 0.5*4 = 4; G0 = 1 + 0.5*4 = 3; padding 0
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), torch.tensor([[3.0, 4.0, 4.0, 0.0]]))
    # gamma = 1 (reverse cumsum path): G = [7, 6, 4, 0]
    assert torch.allclose(discounted_returns(rewards, mask, 1.0), torch.tensor([[7.0, 6.0, 4.0, 0.0]]))
    # against the per-timestep loop on random rewards and masks
    random = torch.randn(5, 17)
    rmask = torch.rand(5, 17) > 0.3
    expected = discounted_reverse_cumsum_loop(random * rmask, 0.9) * rmask
    assert torch.allclose(discounted_returns(random, rmask, 0.9), expected, atol=1e-5)


def test_group_estimators_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3); (r - 0.5) * sqrt(3)
    half_sqrt3 = 0.5 * math.sqrt(3.0)
    expected = torch.tensor([[half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(group_norm(r), expected, atol=1e-6)
    # rloo: r_i - (sum - r_i)/(n-1): row 0, i=0: 1 - 1/3 = 2/3; i=1: 0 - 2/3 = -2/3
    assert torch.allclose(rloo(r)[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.allclose(rloo(r)[1], torch.zeros(4))
    assert torch.allclose(reinforce_baseline(r)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # dr_grpo: r - mean(r), no std division: [0.5, -0.5, -0.5, 0.5] and zeros
    assert torch.allclose(dr_grpo(r), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(reinforce(r), r)
    assert get_estimator("grpo").name == "group_norm"
    with pytest.raises(KeyError):
        get_estimator("ppo_but_wrong")


def _rollout(mask: torch.Tensor) -> Rollout:
    b, a = mask.shape
    return Rollout(
        sequences=torch.zeros(b, a + 2, dtype=torch.int64), attention_mask=torch.ones(b, a + 2, dtype=torch.int64),
        action_mask=mask, response_length=mask.sum(1), total_length=mask.sum(1) + 2,
        prompt_index=(0,) * b, sample_index=tuple(range(b)), prompt_texts=("p",) * b, response_texts=("r",) * b,
        policy_version=(0,) * b, rollout_log_probs=torch.zeros(b, a),
    )


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_estimate_experience_group_norm_with_kl(use_kl_loss):
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -1.0], [-2.0, -9.0]])
    base = torch.tensor([[-1.5, -1.0], [-1.0, -9.0]])  # k1: [[0.5, 0], [-1, masked]]
    config = ExperienceConfig(n_samples_per_prompt=2, micro_rollout_batch_size=0, estimator=get_estimator("grpo"),
                              kl_coef=0.1, kl_estimator="k1", use_kl_loss=use_kl_loss, gamma=1.0)
    exp = estimate_experience(_rollout(mask), torch.tensor([1.0, 0.0]), {}, logp, base, config, batch_index=3)
    # group_norm([1, 0]) = (±0.5) / (sqrt(0.5) + 1e-9) = ±1/sqrt(2)
    a = 1 / math.sqrt(2)
    beta = 0.0 if use_kl_loss else 0.1
    # row 0 rewards: [-beta*0.5, +a]; returns = reverse cumsum: [a - 0.5 beta, a]
    # row 1 rewards: [+beta*1 - a]; returns: [beta - a, 0]
    expected = torch.tensor([[a - 0.5 * beta, a], [beta - a, 0.0]])
    assert torch.allclose(exp.returns, expected, atol=1e-6)
    assert torch.equal(exp.advantages, exp.returns)
    assert torch.allclose(exp.kl, torch.tensor([[0.5, 0.0], [-1.0, 0.0]]))
    assert exp.base_action_log_probs[1, 1] == 0 and exp.batch_index == 3 and exp.kl_coef == pytest.approx(0.1)


def test_estimate_experience_rejects_partial_groups():
    config = ExperienceConfig(n_samples_per_prompt=2, micro_rollout_batch_size=0, estimator=get_estimator("rloo"),
                              kl_coef=0.0, kl_estimator="k1", use_kl_loss=False, gamma=1.0)
    mask = torch.ones(3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="whole groups"):
        estimate_experience(_rollout(mask), torch.zeros(3), {}, torch.zeros(3, 1), torch.zeros(3, 1), config, 0)

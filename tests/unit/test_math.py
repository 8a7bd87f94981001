"""Experience math on tiny hand-computed tensors; each expected value is derived in a comment."""

import math

import pytest
import torch

from fastexp.rl.advantages import (
    TokenInputs,
    cpgd_advantages,
    get_estimator,
    group_normalize,
    identity,
    leave_one_out,
    mean_baseline,
)
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.kl import compute_approx_kl
from fastexp.rl.options import AdvantageOptions, KLOptions, RewardOptions
from fastexp.rl.processing import (
    clip_with_fraction,
    overlong_penalty,
    running_normalize,
    sequence_mean_kl,
    whiten,
    zero_variance_groups,
)
from fastexp.rl.rewards import (
    compute_reward,
    discounted_returns,
    discounted_reverse_cumsum_loop,
    last_action_index,
)
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.types import ForwardOutputs, Rollout
from services.experience.config import ExperienceConfig
from services.experience.pipeline.statistics import MemoryStatistics, StatisticsKey

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
    assert torch.allclose(group_normalize(r), expected, atol=1e-6)
    # rloo: r_i - (sum - r_i)/(n-1): row 0, i=0: 1 - 1/3 = 2/3; i=1: 0 - 2/3 = -2/3
    assert torch.allclose(leave_one_out(r)[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.allclose(leave_one_out(r)[1], torch.zeros(4))
    # reinforce_baseline and dr_grpo: r - mean(r), no std division: [0.5, -0.5, -0.5, 0.5] and zeros
    assert torch.allclose(mean_baseline(r), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(identity(r), r)
    assert get_estimator("grpo").name == "group_norm"
    for name in ("reinforce", "reinforce_baseline", "dr_grpo", "rloo", "group_norm", "cpgd", "gae"):
        assert get_estimator(name).formula and get_estimator(name).source
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


def _state(kl_coef: float = 0.0, target: float | None = None) -> RunState:
    return RunState(RunningMoments(), KLController(kl_coef, target))


def _estimate(mask, reward, config, logp=None, base=None, values=None, state=None, **kwargs):
    logp = torch.zeros(mask.shape) if logp is None else logp
    base = torch.zeros(mask.shape) if base is None else base
    return estimate_experience(
        _rollout(mask), reward, {}, ForwardOutputs(logp, base, values), config,
        state if state is not None else _state(config.kl.kl_coef), **kwargs,
    )


@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_estimate_experience_group_norm_with_kl(use_kl_loss):
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -1.0], [-2.0, -9.0]])
    base = torch.tensor([[-1.5, -1.0], [-1.0, -9.0]])  # k1: [[0.5, 0], [-1, masked]]
    config = ExperienceConfig(2, get_estimator("grpo"), kl=KLOptions(kl_coef=0.1, use_kl_loss=use_kl_loss))
    exp, _ = _estimate(mask, torch.tensor([1.0, 0.0]), config, logp, base, batch_index=3)
    # group_norm([1, 0]) = (±0.5) / (sqrt(0.5) + 1e-9) = ±1/sqrt(2)
    a = 1 / math.sqrt(2)
    beta = 0.0 if use_kl_loss else 0.1
    # row 0 rewards: [-beta*0.5, +a]; returns = reverse cumsum: [a - 0.5 beta, a]
    # row 1 rewards: [+beta*1 - a]; returns: [beta - a, 0]
    expected = torch.tensor([[a - 0.5 * beta, a], [beta - a, 0.0]])
    assert torch.allclose(exp.returns, expected, atol=1e-6)
    assert torch.equal(exp.advantages, exp.returns)
    assert torch.allclose(exp.shaped_reward, torch.tensor([a, -a]))
    assert torch.allclose(exp.kl, torch.tensor([[0.5, 0.0], [-1.0, 0.0]]))
    assert exp.base_action_log_probs[1, 1] == 0 and exp.batch_index == 3 and exp.kl_coef == pytest.approx(0.1)


def test_estimate_experience_rejects_partial_groups():
    config = ExperienceConfig(2, get_estimator("rloo"))
    with pytest.raises(ValueError, match="whole groups"):
        _estimate(torch.ones(3, 1, dtype=torch.bool), torch.zeros(3), config)


def test_gamma_applies_to_every_batch():
    # the seed pops gamma inside its micro-batch loop: only its first micro-batch is discounted
    config = ExperienceConfig(1, get_estimator("reinforce"), gamma=0.5)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for batch_index in range(3):
        exp, _ = _estimate(mask, torch.tensor([1.0]), config, batch_index=batch_index)
        # rewards [0, 1]: returns [0.5 * 1, 1]
        assert torch.allclose(exp.returns, torch.tensor([[0.5, 1.0]]))


def test_gae_through_estimate_by_hand():
    config = ExperienceConfig(1, get_estimator("gae"), gamma=1.0, lambd=0.5)
    mask = torch.tensor([[True, True, False]])
    values = torch.tensor([[0.5, 0.25, 9.0]])  # padding value 9 is masked
    exp, _ = _estimate(mask, torch.tensor([1.0]), config, values=values)
    # r = [0, 1, 0]; delta_1 = 1 + 0 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25
    # A_1 = 0.75; A_0 = -0.25 + 0.5 * 0.75 = 0.125; returns = A + V = [0.625, 1.0]
    assert torch.allclose(exp.advantages, torch.tensor([[0.125, 0.75, 0.0]]))
    assert torch.allclose(exp.returns, torch.tensor([[0.625, 1.0, 0.0]]))
    assert torch.allclose(exp.values, torch.tensor([[0.5, 0.25, 0.0]]))
    with pytest.raises(ValueError, match="critic"):
        _estimate(mask, torch.tensor([1.0]), config)


def test_cpgd_by_hand():
    # two groups of 2; per-token rewards already include the scalar at the last token
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0], [2.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False], [True, False]])
    adv, ret = cpgd_advantages(TokenInputs(rewards, mask, None, 2, 1.0, 1.0))
    # group 0: s = [1, 3], mean 2, population std 1 -> (s - 2) / (1 + 1e-6) = [-1, 1] on every action token
    # group 1: s = [2, 2], std 0 -> 0
    expected = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5) and torch.equal(adv, ret)


def test_overlong_penalty_by_hand():
    # max_new_tokens 10, buffer 4: no penalty up to 6 tokens, then -(len - 6) / 4 * 0.5 down to -0.5 at 10
    lengths = torch.tensor([3, 6, 8, 10])
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 0.5), torch.tensor([0.0, 0.0, -0.25, -0.5]))


def test_clip_with_fraction_counts_before_clamping():
    values = torch.tensor([[-3.0, 0.5, 2.0], [1.0, 9.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    clipped, fraction = clip_with_fraction(values, 1.5, mask)
    # over the mask: -3 and 2 exceed 1.5 (9 is masked): 2 of 4
    assert fraction == pytest.approx(0.5)
    assert clipped.tolist() == [[-1.5, 0.5, 1.5], [1.0, 1.5, 0.0]]
    assert clip_with_fraction(values, 0.0) == (values, 0.0)  # 0 = off


def test_whiten_over_action_mask_keeps_padding_zero():
    adv = torch.tensor([[1.0, 3.0, 7.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # masked values [1, 3, 5]: mean 3, unbiased std 2 -> [-1, 0, 1]
    out = whiten(adv, mask)
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6)


def test_running_moments_match_the_whole_stream_and_survive_single_values():
    moments = RunningMoments().update(torch.tensor([1.0]))
    assert moments.std == 1.0 and moments.mean == 1.0  # one value: std undefined, no scaling (seed: inf)
    moments = moments.update(torch.tensor([2.0, 3.0])).update(torch.tensor([4.0, 10.0]))
    stream = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0], dtype=torch.float64)
    assert moments.count == 5 and moments.mean == pytest.approx(4.0)
    assert moments.std == pytest.approx(float(stream.std(unbiased=True)))
    out, mean, scale = running_normalize(torch.tensor([4.0, 10.0]), moments, minus_mean=True)
    assert mean == pytest.approx(4.0) and torch.allclose(out, torch.tensor([0.0, 6.0 / scale]))
    # all rewards equal so far: std 0 -> left unscaled instead of inf/NaN
    flat = RunningMoments().update(torch.zeros(4))
    assert running_normalize(torch.zeros(4), flat, minus_mean=False)[0].tolist() == [0.0] * 4


def test_adaptive_kl_controller_by_hand():
    # beta * (1 + clip(kl/target - 1, -0.2, 0.2) * n / horizon)
    ctl = KLController(0.1, target=1.0, horizon=100)
    assert ctl.update(1.1, 10).value == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert ctl.update(5.0, 10).value == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # clipped at +0.2
    assert ctl.update(0.0, 50).value == pytest.approx(0.1 * (1 - 0.2 * 0.5))
    assert KLController(0.1).update(5.0, 10).value == 0.1  # fixed


async def test_memory_statistics_keep_latest_state_per_key_and_evict_lru():
    store = MemoryStatistics(max_runs=2)
    initial = RunState(RunningMoments(), KLController(0.1, 1.0))
    a, b, c = StatisticsKey("a"), StatisticsKey("b"), StatisticsKey("c")

    def put(state):
        return lambda _old, _counted: (state, None)

    await store.advance(a, initial, put(RunState(RunningMoments(3, 1.0, 2.0), KLController(0.2, 1.0))))
    await store.advance(b, initial, put(initial))
    assert store.get(a, initial).kl.value == 0.2  # "a" is now most recent
    await store.advance(c, initial, put(initial))
    assert len(store) == 2 and store.get(b, RunState(RunningMoments(), KLController(0.7))).kl.value == 0.7
    # the request's target/horizon apply; only beta's value carries over
    assert store.get(a, RunState(RunningMoments(), KLController(0.5, 2.0, 7))).kl == KLController(0.2, 2.0, 7)
    # a scoped key is another key: the same run id under another principal starts afresh
    assert store.get(StatisticsKey("a", "sha256:bob"), initial) == initial


def test_sequence_mean_kl_and_zero_variance_groups():
    kl = torch.tensor([[1.0, 3.0], [4.0, 0.0], [9.0, 9.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    # per-row means over actions: 2 and 4; the empty row is left out
    assert sequence_mean_kl(kl, mask) == pytest.approx(3.0)
    assert zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [True, False, True]


def test_estimate_applies_stages_in_the_seed_order():
    # one group of 2, overlong on, running norm, reward clip, whitening and advantage clip, adaptive beta
    config = ExperienceConfig(
        2, get_estimator("rloo"), kl=KLOptions(kl_coef=0.5, kl_target=0.1, kl_horizon=4),
        reward=RewardOptions(reward_running_norm=True, reward_clip=0.5, overlong_buffer_len=2,
                             overlong_buffer_penalty_factor=1.0, max_new_tokens=3),
        advantage=AdvantageOptions(advantages_norm=True, advantage_clip=0.9),
    )
    mask = torch.tensor([[True, True, True], [True, False, False]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    base = torch.tensor([[-1.2, -1.0, -1.0], [-1.0, 0.0, 0.0]])  # k1 = [[0.2, 0, 0], [0, ., .]]
    exp, state = _estimate(mask, torch.tensor([1.0, 1.0]), config, logp, base,
                           state=RunState(RunningMoments(), KLController(0.5, 0.1, 4)))
    # overlong: lengths [3, 1], max 3, buffer 2 -> penalty [-(3 - 1) / 2, 0] = [-1, 0] -> R = [0, 1]
    # rloo: [0 - 1, 1 - 0] = [-1, 1]; running moments of [-1, 1]: mean 0, std sqrt(2) -> [-1/√2, 1/√2]
    # reward clip 0.5: [-0.5, 0.5], both rows changed
    assert exp.reward_norm_std == pytest.approx(math.sqrt(2)) and exp.reward_clip_frac == 1.0
    assert torch.allclose(exp.shaped_reward, torch.tensor([-0.5, 0.5]))
    # r = [[-0.5*0.2, 0, -0.5], [0.5, ., .]] -> returns [[-0.6, -0.5, -0.5], [0.5, 0, 0]]
    assert torch.allclose(exp.returns, torch.tensor([[-0.6, -0.5, -0.5], [0.5, 0.0, 0.0]]), atol=1e-6)
    # whitening of [-0.6, -0.5, -0.5, 0.5]: mean -0.275, unbiased std 0.525 -> then clip at 0.9
    values = torch.tensor([-0.6, -0.5, -0.5, 0.5])
    white = (values - values.mean()) / (values.std() + 1e-9)
    assert torch.allclose(exp.advantages[mask], white.clamp(-0.9, 0.9), atol=1e-6)
    assert exp.advantage_clip_frac == pytest.approx(float((white.abs() > 0.9).float().mean()))
    assert exp.kl_coef == 0.5  # beta used for this batch
    # mean per-sequence KL = (0.2/3 + 0) / 2; error = clip(kl/0.1 - 1) = -0.2/3 ... -> beta * (1 + e * 2 / 4)
    error = max(min((0.2 / 3 / 2) / 0.1 - 1, 0.2), -0.2)
    assert state.kl.value == pytest.approx(0.5 * (1 + error * 2 / 4))
    assert state.reward_moments.count == 2


def test_seed_info_view_to_device_and_pin_memory():
    """``exp.info`` has the seed's keys as (B,) float32, computed from the typed fields, read-only."""
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -1.0], [-2.0, -9.0]])
    base = torch.tensor([[-1.5, -1.0], [-1.0, -9.0]])  # k1 per token: [[0.5, 0], [-1, masked]]
    config = ExperienceConfig(2, get_estimator("grpo"), kl=KLOptions(kl_coef=0.1), reward=RewardOptions(reward_clip=0.5))
    exp, _ = _estimate(mask, torch.tensor([1.0, 0.0]), config, logp, base)
    info = exp.info
    assert set(info) == {"reward", "response_length", "total_length", "kl", "return", "reward_clip_frac",
                         "advantage_clip_frac", "rollout_is_clip_frac", "reward_metrics"}
    assert torch.equal(info["kl"], torch.tensor([0.25, -1.0]))  # per-row mean over action_mask
    assert torch.equal(info["response_length"], torch.tensor([2.0, 1.0]))
    assert torch.equal(info["total_length"], torch.tensor([4.0, 3.0]))
    assert torch.equal(info["reward"], torch.tensor([1.0, 0.0]))
    # gamma = 1: the return at the first token is the sum of the per-token rewards (shaped reward - beta * kl)
    assert torch.allclose(info["return"], torch.tensor([0.5 - 0.1 * 0.5, -0.5 + 0.1]))
    assert torch.equal(info["reward_clip_frac"], torch.tensor([1.0, 1.0]))  # ±1/sqrt(2) both clipped to ±0.5
    assert all(value.dtype == torch.float32 for key, value in info.items() if key != "reward_metrics")
    with pytest.raises(TypeError):
        info["reward"] = torch.zeros(2)
    moved = exp.to_device("cpu")
    assert isinstance(moved, type(exp)) and torch.equal(moved.returns, exp.returns) and moved.prompt_index == (0, 0)
    assert exp.pin_memory() is exp or exp.pin_memory().returns.is_pinned()  # pinned only with an accelerator
    without_reference, _ = estimate_experience(_rollout(mask), torch.tensor([1.0, 0.0]), {},
                                               ForwardOutputs(logp, None), ExperienceConfig(2, get_estimator("grpo"),
                                               kl=KLOptions(kl_coef=0.0)), _state())
    assert torch.equal(without_reference.info["kl"], torch.zeros(2))

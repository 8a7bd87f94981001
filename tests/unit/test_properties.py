"""Property tests (hypothesis) of the experience math's invariants over random shapes, masks and settings."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastexp.packing import pack_experience, unpack_experience
from fastexp.rl.advantages import (
    ESTIMATORS,
    TokenInputs,
    cpgd_advantages,
    get_estimator,
    group_normalize,
    leave_one_out,
)
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.options import AdvantageOptions, KLOptions, RewardOptions
from fastexp.rl.processing import whiten
from fastexp.rl.rewards import discounted_returns, discounted_reverse_cumsum_loop, gae, gae_loop
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.types import ForwardOutputs, Rollout
from fastexp.wire import experience_from_pb, experience_to_pb
from services.experience.config import ExperienceConfig

settings.register_profile("fastexp", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("fastexp")

unit = st.floats(0.0, 1.0, allow_nan=False)


def _mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Right-padded action mask: row i has lengths[i] leading true positions."""
    return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)


def _batch(seed: int, groups: int, n: int, width: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (groups * n,), generator=g)
    mask = _mask(lengths, width)
    rewards = torch.randint(0, 3, (groups * n,), generator=g).float()  # ties are common, as with verifiers
    logp = -torch.rand(groups * n, width, generator=g) * 3
    base = -torch.rand(groups * n, width, generator=g) * 3
    values = torch.randn(groups * n, width, generator=g)
    return mask, rewards, logp, base, values


def _rollout(mask: torch.Tensor, prompt: int = 2) -> Rollout:
    b, a = mask.shape
    sequences = torch.arange(b * (prompt + a)).view(b, prompt + a) % 97 + 3
    attention = torch.cat([torch.ones(b, prompt, dtype=torch.int64), mask.long()], dim=1)
    sequences = torch.where(attention.bool(), sequences, 0)
    return Rollout(
        sequences, attention, mask, mask.sum(1), attention.sum(1), tuple(range(b)), (0,) * b, ("p",) * b,
        ("r",) * b, (0,) * b, torch.zeros(b, a),
    )


@given(
    seed=st.integers(0, 2**16), groups=st.integers(1, 3), n=st.integers(2, 4), width=st.integers(1, 9),
    estimator=st.sampled_from(sorted(ESTIMATORS)), gamma=unit, lambd=unit, whiten_=st.booleans(),
    clip=st.sampled_from([0.0, 0.5]), reward_clip=st.sampled_from([0.0, 0.3]), norm=st.booleans(),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
)
def test_every_output_is_zero_where_action_mask_is_false(
    seed, groups, n, width, estimator, gamma, lambd, whiten_, clip, reward_clip, norm, kl_estimator
):
    mask, rewards, logp, base, values = _batch(seed, groups, n, width)
    config = ExperienceConfig(
        n, get_estimator(estimator), gamma=gamma, lambd=lambd, kl=KLOptions(kl_coef=0.1, kl_estimator=kl_estimator),
        reward=RewardOptions(reward_running_norm=norm, reward_clip=reward_clip),
        advantage=AdvantageOptions(advantages_norm=whiten_, advantage_clip=clip),
    )
    experience, _ = estimate_experience(
        _rollout(mask), rewards, {}, ForwardOutputs(logp, base, values), config,
        RunState(RunningMoments(), KLController(0.1)),
    )
    for name in ("advantages", "returns", "kl", "action_log_probs", "base_action_log_probs", "values"):
        tensor = getattr(experience, name)
        assert torch.all(tensor[~mask] == 0), name
        assert torch.isfinite(tensor).all(), name
    if clip:
        assert experience.advantages.abs().max() <= clip + 1e-6
    if reward_clip:
        assert experience.shaped_reward.abs().max() <= reward_clip + 1e-6


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 4), n=st.integers(2, 6))
def test_group_normalized_rewards_have_zero_group_mean_and_unit_std(seed, groups, n):
    rewards = torch.randn(groups, n, generator=torch.Generator().manual_seed(seed))
    shaped = group_normalize(rewards)
    assert torch.allclose(shaped.mean(dim=1), torch.zeros(groups), atol=1e-5)
    assert torch.allclose(shaped.std(dim=1, unbiased=True), torch.ones(groups), atol=1e-4)


@given(seed=st.integers(0, 2**16), n=st.integers(2, 6), index=st.integers(0, 5), bump=st.floats(-5, 5))
def test_rloo_baseline_excludes_the_sample_itself(seed, n, index, bump):
    index %= n
    rewards = torch.randn(1, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    baseline = rewards - leave_one_out(rewards)
    others = torch.cat([rewards[0, :index], rewards[0, index + 1 :]])
    assert torch.allclose(baseline[0, index], others.mean(), atol=1e-5)
    changed = rewards.clone()
    changed[0, index] += bump
    # the sample's own reward does not move its baseline
    assert torch.allclose((changed - leave_one_out(changed))[0, index], baseline[0, index], atol=1e-4)


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), width=st.integers(2, 12))
def test_whitening_gives_zero_mean_unit_variance_over_the_action_mask(seed, rows, width):
    g = torch.Generator().manual_seed(seed)
    mask = _mask(torch.randint(1, width + 1, (rows,), generator=g), width)
    if mask.sum() < 2:
        return
    advantages = torch.randn(rows, width, generator=g) * 3 + 1
    out = whiten(advantages, mask)
    selected = out[mask]
    assert abs(float(selected.mean())) < 1e-5
    assert abs(float(selected.std(unbiased=True)) - 1.0) < 1e-4
    assert torch.all(out[~mask] == 0)


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 3), n=st.integers(2, 4), width=st.integers(1, 8))
def test_cpgd_advantages_are_one_value_per_row_with_zero_group_mean(seed, groups, n, width):
    g = torch.Generator().manual_seed(seed)
    mask = _mask(torch.randint(1, width + 1, (groups * n,), generator=g), width)  # every row has an action
    token_rewards = torch.randn(groups * n, width, generator=g) * mask
    advantages, returns = cpgd_advantages(TokenInputs(token_rewards, mask, None, n, 1.0, 1.0))
    per_row = advantages[:, 0]
    assert torch.allclose(advantages, per_row.unsqueeze(1) * mask, atol=1e-6)  # broadcast over the row's actions
    assert torch.allclose(per_row.view(groups, n).mean(dim=1), torch.zeros(groups), atol=1e-4)
    assert torch.equal(advantages, returns)


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), width=st.integers(1, 200), gamma=unit, lambd=unit)
def test_vectorized_gae_and_returns_match_the_loops(seed, rows, width, gamma, lambd):
    g = torch.Generator().manual_seed(seed)
    mask = _mask(torch.randint(0, width + 1, (rows,), generator=g), width)
    rewards = torch.randn(rows, width, generator=g)
    values = torch.randn(rows, width, generator=g)
    fast_adv, fast_ret = gae(rewards, values, mask, gamma, lambd)
    loop_adv, loop_ret = gae_loop(rewards, values, mask, gamma, lambd)
    assert torch.allclose(fast_adv, loop_adv, atol=1e-4) and torch.allclose(fast_ret, loop_ret, atol=1e-4)
    expected = discounted_reverse_cumsum_loop(rewards * mask, gamma) * mask
    assert torch.allclose(discounted_returns(rewards, mask, gamma), expected, atol=1e-4)


@given(seed=st.integers(0, 2**16), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_running_moments_equal_the_whole_stream(seed, chunks):
    values = torch.randn(sum(chunks), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 + 1
    moments = RunningMoments()
    for piece in values.split(chunks):
        moments = moments.update(piece)
    assert moments.count == values.numel()
    assert abs(moments.mean - float(values.mean())) < 1e-9
    if values.numel() > 1:
        assert abs(moments.std - float(values.std(unbiased=True))) < 1e-9


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 3), n=st.integers(1, 3), width=st.integers(1, 7))
def test_pack_then_unpack_is_the_identity(seed, groups, n, width):
    mask, rewards, logp, base, values = _batch(seed, groups, n, width)
    mask[0, 0] = True  # at least one action, so the padded width is the widest response
    mask = _mask(mask.sum(1), width)
    width = int(mask.sum(1).max())
    mask, logp, base, values = mask[:, :width], logp[:, :width], base[:, :width], values[:, :width]
    config = ExperienceConfig(n, get_estimator("gae"), lambd=0.9)
    experience, _ = estimate_experience(
        _rollout(mask), rewards, {}, ForwardOutputs(logp, base, values), config, RunState(RunningMoments(),
                                                                                        KLController(0.0)),
    )
    back = unpack_experience(pack_experience(experience), pad_token_id=0)
    for name in ("sequences", "attention_mask", "action_mask", "advantages", "returns", "values", "kl"):
        assert torch.equal(getattr(back, name), getattr(experience, name)), name


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 3), n=st.integers(2, 3), width=st.integers(1, 7),
       packed=st.booleans())
def test_without_a_reference_kl_is_absent_and_survives_the_wire_and_packing(seed, groups, n, width, packed):
    """No reference ran (kl_coef 0): no KL anywhere; the absent fields stay absent through packing and the wire,
    and the rewards are the estimator's alone (r_t = [t = last] R)."""
    mask, rewards, logp, _, _ = _batch(seed, groups, n, width)
    config = ExperienceConfig(n, get_estimator("rloo"), kl=KLOptions(kl_coef=0.0))
    experience, state = estimate_experience(
        _rollout(mask), rewards, {}, ForwardOutputs(logp, None), config, RunState(RunningMoments(), KLController(0.0)),
    )
    assert experience.kl is None and experience.base_action_log_probs is None
    assert state.kl.value == 0.0
    has_actions = mask.any(dim=1)
    assert torch.allclose(experience.returns[has_actions, 0], experience.shaped_reward[has_actions])
    sent = pack_experience(experience) if packed else experience
    back = experience_from_pb(experience_to_pb(sent))
    assert back.kl is None and back.base_action_log_probs is None
    assert torch.equal(back.advantages, sent.advantages)

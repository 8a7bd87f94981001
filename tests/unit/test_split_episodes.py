"""Agent episodes split into several rows (the agent's framework rewrote the conversation): group statistics are
taken over episodes, every row of an episode gets the episode's shaped reward, and batches cut whole groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastexp.rl.advantages import get_estimator
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.options import RewardOptions
from fastexp.rl.processing import episode_ids
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.types import ForwardOutputs
from services.common.generation import CompletionRecord
from services.experience.config import ExperienceConfig, PromptSpec
from services.experience.pipeline.assembly import group_batches, split_experience
from services.experience.workers.sequences import build_rollout

PAD = 0
PROMPTS = [PromptSpec("p0", (5, 6), "", ""), PromptSpec("p1", (7,), "", "")]


def _row(prompt: int, sample: int, length: int, first: int = 10) -> CompletionRecord:
    ids = tuple(range(first, first + length))
    return CompletionRecord(prompt, sample, PROMPTS[prompt].token_ids, ids, -np.ones(length, dtype=np.float32),
                            "stop", "", policy_version=0, action_mask=(1,) * length, num_turns=1)


def _estimate(rows: list[CompletionRecord], rewards: list[float], estimator: str, reward: RewardOptions):
    rollout = build_rollout(rows, PROMPTS, PAD)
    zeros = torch.zeros(rollout.action_mask.shape)
    config = ExperienceConfig(2, get_estimator(estimator), reward=reward)
    state = RunState(RunningMoments(), KLController(0.0))
    return estimate_experience(rollout, torch.tensor(rewards), {}, ForwardOutputs(zeros, None, None), config, state)


def test_episode_ids_number_runs_of_one_prompt_and_sample():
    assert episode_ids((0, 0, 0, 1, 1, 1), (0, 1, 1, 0, 0, 1)).tolist() == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "dr_grpo", "reinforce_baseline"])
def test_a_split_episode_shapes_like_its_unsplit_self_on_every_row(estimator):
    reward = RewardOptions(overlong_buffer_len=4, max_new_tokens=8, overlong_buffer_penalty_factor=1.0,
                           reward_running_norm=True)
    whole = [_row(0, 0, 5), _row(0, 1, 6), _row(1, 0, 3), _row(1, 1, 2)]
    split = [_row(0, 0, 5), _row(0, 1, 2), _row(0, 1, 4, first=40), _row(1, 0, 3), _row(1, 1, 2)]
    expected, expected_state = _estimate(whole, [1.0, 0.0, 0.5, 0.25], estimator, reward)
    got, state = _estimate(split, [1.0, 0.0, 0.0, 0.5, 0.25], estimator, reward)
    torch.testing.assert_close(got.shaped_reward, expected.shaped_reward[torch.tensor([0, 1, 1, 2, 3])])
    assert state.reward_moments == expected_state.reward_moments  # the running norm counts episodes
    last = got.action_mask.long().cumsum(1).argmax(1)  # each row's last action carries its shaped reward
    torch.testing.assert_close(got.returns[torch.arange(5), last], got.shaped_reward)


def test_an_estimator_that_groups_rows_refuses_split_episodes():
    with pytest.raises(ValueError, match="one row per episode"):
        _estimate([_row(0, 0, 2), _row(0, 1, 2), _row(0, 1, 3), _row(1, 0, 2), _row(1, 1, 1)],
                  [1.0, 0.0, 0.0, 0.5, 0.2], "cpgd", RewardOptions())


def test_batches_cut_whole_groups_however_many_rows_they_have():
    assert group_batches((0, 0, 0, 1, 1, 2, 2), 2) == [slice(0, 5), slice(5, 7)]
    rows = [_row(0, 0, 5), _row(0, 1, 2), _row(0, 1, 4, first=40), _row(1, 0, 3), _row(1, 1, 2)]
    experience, _ = _estimate(rows, [1.0, 0.0, 0.0, 0.5, 0.25], "group_norm", RewardOptions())
    parts = split_experience(experience, 1)
    assert [p.prompt_index for p in parts] == [(0, 0, 0), (1, 1)]
    assert [p.sample_index for p in parts] == [(0, 1, 1), (0, 1)]

"""The producer's admission decisions (pure): refill rounds for dynamic sampling, batches admitted by version."""

from __future__ import annotations

from fastexp.rl.advantages import get_estimator
from services.experience.config import DynamicSamplingOptions, ExperienceConfig
from services.experience.pipeline import admission


def _rounds(config: ExperienceConfig, prompts: int, kept_per_round: list[int]) -> list[range]:
    """The rounds started when each round keeps the given number of groups."""
    rounds, started = admission.first_rounds(config, prompts), []
    for kept in kept_per_round:
        indices = admission.next_round(rounds)
        if indices is None:
            break
        started.append(indices)
        rounds = admission.after_round(rounds, indices, kept)
    return started


def test_without_dynamic_sampling_one_round_starts_every_prompt():
    config = ExperienceConfig(2, get_estimator("group_norm"))
    assert _rounds(config, 5, [3, 2]) == [range(0, 5)]


def test_refill_rounds_start_as_many_prompts_as_groups_are_missing():
    config = ExperienceConfig(2, get_estimator("group_norm"), dynamic_sampling=DynamicSamplingOptions(3, 3))
    assert _rounds(config, 10, [1, 1, 0, 1]) == [range(0, 3), range(3, 5), range(5, 6), range(6, 7)]


def test_refill_rounds_stop_at_the_target_the_round_limit_or_the_last_prompt():
    dynamic = ExperienceConfig(2, get_estimator("group_norm"), dynamic_sampling=DynamicSamplingOptions(3, 1))
    assert _rounds(dynamic, 10, [0, 0, 0]) == [range(0, 3), range(3, 6)]  # 1 + max_extra_rounds rounds
    assert _rounds(dynamic, 4, [0, 0]) == [range(0, 3), range(3, 4)]  # prompts run out
    assert _rounds(dynamic, 10, [3, 0]) == [range(0, 3)]  # target reached


def test_batches_are_admitted_at_v0_plus_b_minus_s():
    assert admission.admitted_batches(5, 2) == (range(0, 2), range(2, 4), range(4, 5))
    assert [admission.admission_version(7, b, 1) for b in range(3)] == [6, 7, 8]

"""RequestOptions check their own ranges on construction, naming the field; options a trainer leaves unset stay
unset on the wire, so the service's defaults (kept there alone) apply."""

from __future__ import annotations

import math

import pytest

from fastexp import RequestOptions, build_request
from fastexp.request import InvalidOption

BAD = [
    ("n_samples_per_prompt", 0), ("gamma", 1.5), ("lambd", -0.1), ("kl_coef", -1.0), ("kl_target", 0.0),
    ("kl_horizon", 0), ("reward_clip", math.nan), ("advantage_clip", -2.0), ("overlong_buffer_penalty_factor", -1.0),
    ("dynamic_sampling_max_extra_rounds", -1), ("max_staleness", -1), ("max_turns", 2**32),
    ("rollout_is_threshold", 0.5), ("partial_rollout", "later"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[field for field, _ in BAD])
def test_an_option_out_of_range_is_refused_on_construction_naming_its_field(field, value):
    with pytest.raises(InvalidOption) as raised:
        RequestOptions(**{"n_samples_per_prompt": 2, field: value})
    assert raised.value.field == field and f"RequestOptions.{field}: " in str(raised.value)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(InvalidOption):  # keyword overrides are checked the same way
        build_request(["a"], RequestOptions(n_samples_per_prompt=2), **{field: value})


def test_the_edges_of_each_range_are_accepted():
    RequestOptions(n_samples_per_prompt=1, gamma=0.0, lambd=1.0, kl_coef=0.0, kl_horizon=1, kl_target=1e-9,
                   rollout_is="token", rollout_is_threshold=1.0, max_staleness=0, dynamic_sampling_max_extra_rounds=0)


def test_options_left_unset_stay_unset_on_the_wire():
    message = build_request(["a"], n_samples_per_prompt=2)
    assert not any(message.HasField(name) for name in ("gamma", "lambd", "max_staleness"))
    assert not any(message.kl.HasField(name) for name in ("kl_coef", "kl_target", "kl_horizon"))
    assert not message.reward_processing.HasField("overlong_buffer_penalty_factor")
    assert not message.dynamic_sampling.HasField("max_extra_rounds")
    assert not message.rollout_correction.HasField("threshold")
    # plain strings and counts on the wire: unset is empty / 0, which the service reads as "its default"
    assert message.advantage_estimator == "" and message.kl.kl_estimator == ""
    assert message.sampling.max_new_tokens == 0


def test_options_set_to_the_services_default_are_sent():
    message = build_request(["a"], n_samples_per_prompt=2, gamma=1.0, kl_coef=0.01, dynamic_sampling_max_extra_rounds=3)
    assert message.HasField("gamma") and message.gamma == 1.0 and message.kl.HasField("kl_coef")
    assert message.dynamic_sampling.HasField("max_extra_rounds") and message.dynamic_sampling.max_extra_rounds == 3

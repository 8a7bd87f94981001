"""The fleet's routing policy (services.experience.fleet.routing): least outstanding work, prefix affinity where it pays."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.experience.fleet.routing import (
    GroupWork,
    assign_groups,
    choose_replica,
    group_work,
    place_groups,
    prefix_key,
)


def _group(key: str = "k", prompt: int = 100, decode: int = 400) -> GroupWork:
    return GroupWork(key, prompt, decode)


def test_the_least_loaded_replica_wins_and_ties_go_to_the_name():
    assert choose_replica({"a": 500, "b": 100, "c": 300}, _group()) == "b"
    assert choose_replica({"b": 0, "a": 0}, _group()) == "a"


def test_affinity_wins_when_it_saves_more_prefill_than_the_extra_load():
    group = _group(prompt=100)
    # "a" holds the prompt: its cost is 150 + decode; "b" must prefill: 80 + 100 + decode
    assert choose_replica({"a": 150, "b": 80}, group, warm={"a"}) == "a"
    # ... but not when "a" is busier by more than the prefill it would save
    assert choose_replica({"a": 250, "b": 80}, group, warm={"a"}) == "b"


def test_groups_of_a_round_spread_over_equal_replicas():
    groups = [_group(f"p{i}") for i in range(6)]
    assert assign_groups({"a": 0, "b": 0, "c": 0}, groups) == ["a", "b", "c", "a", "b", "c"]


def test_a_busy_replica_gets_groups_only_once_the_others_caught_up():
    groups = [_group(f"p{i}", prompt=0, decode=100) for i in range(4)]
    assert assign_groups({"a": 250, "b": 0}, groups) == ["b", "b", "b", "a"]


def test_a_prompt_placed_earlier_in_the_round_makes_its_replica_warm():
    same = [_group("same", prompt=1000, decode=100), _group("same", prompt=1000, decode=100)]
    assert assign_groups({"a": 0, "b": 150}, same) == ["a", "a"]  # a second prefill on b costs more
    different = [_group("one", prompt=1000, decode=100), _group("two", prompt=1000, decode=100)]
    assert assign_groups({"a": 0, "b": 150}, different) == ["a", "b"]
    assert assign_groups({"a": 0, "b": 0}, same) == ["a", "b"]  # an idle replica beats a shared prefill


def test_warm_replicas_come_from_the_callback():
    groups = [_group("x"), _group("y")]
    warm = {"x": {"b"}, "y": set()}
    assert assign_groups({"a": 0, "b": 0}, groups, lambda g: warm[g.prefix_key]) == ["b", "a"]


def test_no_replica_is_an_error():
    with pytest.raises(ValueError, match="no replica"):
        choose_replica({}, _group())


def test_group_work_and_prefix_keys():
    work = group_work([1, 2, 3], n_samples_per_prompt=4, max_tokens=16)
    assert (work.prompt_tokens, work.decode_tokens, work.tokens) == (3, 64, 67)
    assert prefix_key([1, 2, 3]) == work.prefix_key != prefix_key([1, 2, 4])


@given(
    loads=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 10_000), min_size=1),
    decodes=st.lists(st.integers(1, 500), min_size=1, max_size=30),
)
def test_without_affinity_the_spread_never_exceeds_one_group(loads, decodes):
    """Greedy least-loaded placement: after placing, no replica that received work is more than one group's work
    above the least loaded replica (the classic list-scheduling bound)."""
    groups = [GroupWork(f"p{i}", 0, d) for i, d in enumerate(decodes)]
    chosen = assign_groups(loads, groups)
    final = dict(loads)
    for name, group in zip(chosen, groups, strict=True):
        final[name] += group.tokens
    largest = max(g.tokens for g in groups)
    for name in set(chosen):
        assert final[name] - min(final.values()) <= largest


def test_with_a_cap_groups_wait_for_room_and_an_idle_replica_takes_any_group():
    groups = [_group(f"p{i}", prompt=0, decode=100) for i in range(5)]
    # cap 8 samples, 4 per group: each replica takes two groups now, the fifth waits
    assert place_groups({"a": 0, "b": 0}, {"a": 0, "b": 0}, groups, 4, 8) == ["a", "b", "a", "b", None]
    # a replica already running 6 samples has no room for 4 more; the idle one takes groups bigger than the cap
    assert place_groups({"a": 0, "b": 0}, {"a": 6, "b": 0}, groups[:2], 4, 3) == ["b", None]
    assert place_groups({"a": 0}, {"a": 0}, groups[:1], 16, 8) == ["a"]
    # without a cap it is assign_groups
    assert place_groups({"a": 0, "b": 0}, {"a": 0, "b": 0}, groups, 4, None) == assign_groups({"a": 0, "b": 0}, groups)

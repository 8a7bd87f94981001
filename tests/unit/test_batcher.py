"""The batcher's decisions, alone: pure functions over an immutable inbox, on hand-made groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastexp.rl.advantages import get_estimator
from fastexp.types import ForwardOutputs
from services.common.generation import CompletionRecord
from services.experience.config import ExperienceConfig
from services.experience.pipeline import batcher
from services.experience.pipeline.batcher import Inbox, Step
from services.experience.pipeline.events import (
    Done,
    Dropped,
    Failed,
    ForwardedGroup,
    GroupsResampled,
    RoundStarted,
    ScoredGroup,
    Scores,
)

N = 2


def _config(**options) -> ExperienceConfig:
    return ExperienceConfig(n_samples_per_prompt=N, estimator=get_estimator("group_norm"), **options)


def _scored(prompt_index: int, version: int = 0, resampled: bool = False) -> ScoredGroup:
    completions = tuple(
        CompletionRecord(prompt_index, s, (1, 2), (3,), np.zeros(1, np.float32), "stop", "x", version)
        for s in range(N)
    )
    return ScoredGroup(completions, Scores(torch.zeros(N), {}), resampled)


def _forwarded(prompt_index: int, version: int = 0) -> ForwardedGroup:
    zeros = torch.zeros(N, 1)
    return ForwardedGroup(_scored(prompt_index, version), ForwardOutputs(zeros, zeros), actor_version=version)


def test_receive_files_each_event_and_leaves_the_old_inbox_as_it_was():
    empty = Inbox()
    one = batcher.receive(empty, _scored(0))
    assert empty.pending == () and [g.prompt_index for g in one.pending] == [0]
    dropped = batcher.receive(one, Dropped(3))
    assert dropped.dropped == (3,) and dropped.pending == one.pending
    assert batcher.receive(dropped, RoundStarted()) is dropped  # counted by the consumer, nothing to hold
    assert batcher.receive(dropped, GroupsResampled(2)) is dropped
    done = batcher.receive(dropped, Done())
    assert done.producer_done and done.finished
    error = RuntimeError("generator gone")
    failed = batcher.receive(batcher.receive(one, Failed(error)), Failed(RuntimeError("later")))
    assert failed.failure is error and failed.finished  # the first failure is the one raised


def test_a_resampled_group_or_drop_settles_what_the_consumer_awaits():
    inbox = Inbox(awaiting=2, producer_done=True)
    assert not inbox.finished  # resamples still to come
    inbox = batcher.receive(inbox, _scored(1, resampled=True))
    inbox = batcher.receive(inbox, Dropped(2, resampled=True))
    assert inbox.awaiting == 0 and inbox.finished


def test_a_resample_whose_episode_failed_is_no_longer_awaited():
    """A resampled multi-turn group that fails in its environment settles its wait (the stream would hang)."""
    from services.experience.pipeline.events import GroupFailed

    inbox = batcher.receive(Inbox(awaiting=1, producer_done=True), GroupFailed(3, "env", resampled=True))
    assert inbox.awaiting == 0 and inbox.finished
    assert batcher.receive(Inbox(awaiting=1), GroupFailed(3, "env")).awaiting == 1  # a first-round failure


@pytest.mark.parametrize(
    ("inbox", "step"),
    [
        (Inbox(), Step.WAIT),
        (Inbox(pending=(_scored(0),)), Step.FORWARD),
        (Inbox(forwarded=(_forwarded(0),)), Step.WAIT),  # one group of a two-group batch: wait for more
        (Inbox(forwarded=(_forwarded(0), _forwarded(1))), Step.DELIVER),
        (Inbox(forwarded=(_forwarded(0),), producer_done=True), Step.DELIVER),  # the last, short batch
        (Inbox(pending=(_scored(1),), forwarded=(_forwarded(0),), producer_done=True), Step.FORWARD),
        (Inbox(producer_done=True), Step.FINISH),
        (Inbox(failure=RuntimeError("x")), Step.FINISH),
    ],
)
def test_next_step_delivers_before_forwarding_and_forwards_before_waiting(inbox, step):
    assert batcher.next_step(inbox, _config(micro_rollout_batch_size=2 * N)) is step


def test_rollout_scope_delivers_only_once_everything_is_in():
    config = _config(micro_rollout_batch_size=N, normalization_scope="rollout")
    many = tuple(_forwarded(i) for i in range(5))
    assert batcher.next_step(Inbox(forwarded=many), config) is Step.WAIT
    finished = Inbox(forwarded=many, producer_done=True)
    assert batcher.next_step(finished, config) is Step.DELIVER
    assert len(batcher.take_batch(finished, config, None).groups) == 5


def test_take_pending_takes_the_oldest_groups_up_to_the_rows_and_at_least_one():
    inbox = Inbox(pending=tuple(_scored(i) for i in range(5)))
    taken, rest = batcher.take_pending(inbox, max_rows=3 * N, n=N)
    assert [g.prompt_index for g in taken] == [0, 1, 2] and [g.prompt_index for g in rest.pending] == [3, 4]
    taken, _ = batcher.take_pending(inbox, max_rows=1, n=N)
    assert [g.prompt_index for g in taken] == [0]


def test_take_batch_in_arrival_order():
    inbox = Inbox(forwarded=tuple(_forwarded(i) for i in (4, 1, 3)))
    take = batcher.take_batch(inbox, _config(micro_rollout_batch_size=2 * N), oldest_version=None)
    assert [g.scored.prompt_index for g in take.groups] == [4, 1]
    assert [g.scored.prompt_index for g in take.inbox.forwarded] == [3] and not take.resample


def test_stale_groups_go_back_for_resampling_and_no_batch_is_taken():
    inbox = Inbox(forwarded=(_forwarded(0, version=0), _forwarded(1, version=2), _forwarded(2, version=1)))
    take = batcher.take_batch(inbox, _config(micro_rollout_batch_size=N), oldest_version=1)
    assert take.groups == () and [g.scored.prompt_index for g in take.resample] == [0]
    assert [g.scored.prompt_index for g in take.inbox.forwarded] == [1, 2]
    assert take.inbox.awaiting == 1 and not take.abandoned
    again = batcher.take_batch(take.inbox, _config(micro_rollout_batch_size=N), oldest_version=1)
    assert [g.scored.prompt_index for g in again.groups] == [1]  # all fresh now: a batch


def test_after_a_failure_stale_groups_are_abandoned_not_resampled():
    inbox = Inbox(forwarded=(_forwarded(0, version=0),), failure=RuntimeError("gone"))
    take = batcher.take_batch(inbox, _config(micro_rollout_batch_size=N), oldest_version=1)
    assert take.groups == () and take.resample == () and len(take.abandoned) == 1
    assert take.inbox.awaiting == 0 and take.inbox.forwarded == ()


def test_reported_drops_go_with_one_batch():
    drops, inbox = batcher.reported_drops(Inbox(dropped=(2, 5)))
    assert drops == (2, 5) and inbox.dropped == ()


def test_finished_samples_are_forwarded_early_only_when_nothing_else_is_to_do():
    """A sample of a group still generating waits for an early forward; its group arriving (or being dropped)
    takes it back, and scored groups always go first."""
    from services.experience.pipeline.events import GroupFailed, SampleFinished

    first, second = _scored(0).completions[0], _scored(1).completions[0]
    inbox = batcher.receive(batcher.receive(Inbox(), SampleFinished(first)), SampleFinished(second))
    assert inbox.finished_samples == (first, second)
    assert batcher.next_step(inbox, _config()) is Step.FORWARD_EARLY
    taken, rest = batcher.take_finished_samples(inbox, 1)
    assert taken == (first,) and rest.finished_samples == (second,)
    with_group = batcher.receive(inbox, _scored(0))
    assert with_group.finished_samples == (second,)  # group 0's sample goes with its group
    assert batcher.next_step(with_group, _config()) is Step.FORWARD  # scored groups first
    assert batcher.receive(inbox, Dropped(1)).finished_samples == (first,)
    assert batcher.receive(inbox, GroupFailed(0, "env")).finished_samples == (second,)
    failed = batcher.receive(inbox, Failed(RuntimeError("generator down")))
    assert batcher.next_step(failed, _config()) is Step.FINISH  # no early work once the stream failed

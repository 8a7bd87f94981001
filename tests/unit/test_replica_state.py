"""A generator replica's states (services.experience.fleet.replica_state): the transition table the replica set
checks every change against, and the change signal that waiters wait on instead of polling."""

from __future__ import annotations

import asyncio

import pytest

from services.experience.fleet.replica_state import (
    TRANSITIONS,
    Changes,
    InvalidTransition,
    ReplicaState,
    next_state,
)

S = ReplicaState


def test_every_state_has_its_row_and_staying_put_is_always_allowed():
    assert set(TRANSITIONS) == set(ReplicaState)
    for state in ReplicaState:
        assert next_state(state, state) is state


@pytest.mark.parametrize(("current", "wanted"), [
    (S.CONNECTING, S.SERVING),  # reached at the fleet's version
    (S.CONNECTING, S.SYNCING),  # reached at another version
    (S.SYNCING, S.SERVING),  # synced
    (S.SYNCING, S.CONNECTING),  # the sync failed: its version is unknown
    (S.SERVING, S.DOWN),  # probes or a stream failed
    (S.SERVING, S.CONNECTING),  # a weight update failed
    (S.SERVING, S.SYNCING),  # it restarted at another version
    (S.DOWN, S.SERVING),  # answers again at the fleet's version
    (S.DOWN, S.SYNCING),  # answers again at another version
    (S.DRAINING, S.CONNECTING),  # discovered again before it was closed
    *((state, S.DRAINING) for state in ReplicaState),  # left discovery, from anywhere
])
def test_the_transitions_the_replica_set_makes_are_allowed(current, wanted):
    assert next_state(current, wanted) is wanted


@pytest.mark.parametrize("wanted", [S.SERVING, S.SYNCING, S.DOWN])
def test_a_draining_replica_gets_no_work_and_no_probe_outcome_until_it_is_discovered_again(wanted):
    with pytest.raises(InvalidTransition, match=f"from draining to {wanted}"):
        next_state(S.DRAINING, wanted)


async def test_a_waiter_wakes_on_the_change_that_makes_its_condition_true_and_not_before():
    changes = Changes()
    load = {"a": 3}
    waiting = asyncio.create_task(changes.wait_until(lambda: load["a"] == 0))
    for value in (2, 1):
        load["a"] = value
        changes.notify()
        await asyncio.sleep(0)  # let the waiter look (a yield, not a wait for time)
        await asyncio.sleep(0)
        assert not waiting.done()
    load["a"] = 0
    changes.notify()
    async with asyncio.timeout(5):
        await waiting


async def test_a_condition_already_true_returns_at_once():
    async with asyncio.timeout(5):
        await Changes().wait_until(lambda: True)

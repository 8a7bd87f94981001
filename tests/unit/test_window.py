"""A stream's backpressure window (services.experience.pipeline.window): one lease per prompt group, ended exactly
once, and every lease ended when the stream closes."""

from __future__ import annotations

import asyncio

import pytest

from services.experience.pipeline.window import Window


async def test_a_full_window_admits_the_next_group_only_when_a_lease_ends():
    window = Window(2)
    await window.lease(0)
    await window.lease(1)
    assert not window.has_room()
    waiting = asyncio.create_task(window.lease(2))
    await asyncio.sleep(0)  # a yield: the lease is waiting for room
    assert not waiting.done() and window.held == {0, 1}
    assert window.end([0]) == 1
    async with asyncio.timeout(5):
        await waiting
    assert window.held == {1, 2}


async def test_a_lease_ends_exactly_once_however_often_it_is_ended():
    window = Window(2)
    await window.lease(0)
    assert window.end([0, 0]) == 1
    assert window.end([0, 7]) == 0  # ended before, or never taken: nothing changes
    await window.lease(1)
    await window.lease(2)
    assert not window.has_room()  # the repeated ends gave back one slot, not three


async def test_closing_ends_every_lease_and_takes_no_new_one():
    window = Window(3)
    for index in range(3):
        await window.lease(index)
    assert window.close() == 3
    assert window.held == frozenset() and window.has_room()
    with pytest.raises(RuntimeError, match="closed"):
        await window.lease(3)
    assert window.held == frozenset() and window.has_room()


async def test_a_group_holds_one_lease_and_an_unbounded_window_never_waits():
    window = Window(None)
    for index in range(100):
        await window.lease(index)
    assert window.has_room() and len(window.held) == 100
    with pytest.raises(ValueError, match="prompt 5 holds"):
        await window.lease(5)
    with pytest.raises(ValueError, match="at least one"):
        Window(0)

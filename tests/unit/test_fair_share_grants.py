"""Weighted fair share of the generator's capacity: the pure choice, and the owner's grants under contention."""

from __future__ import annotations

import asyncio
import collections

import pytest

from services.experience.pipeline.fair_share import FairShare, ShareLeases, next_tenant


def test_the_tenant_with_the_lowest_virtual_time_goes_next_ties_to_the_earlier():
    assert next_tenant(("a", "b"), {"a": 1.0, "b": 2.0}) == "a"
    assert next_tenant(("b", "c"), {"b": 1.0, "c": 1.0}) == "b"
    assert next_tenant(("c", "a"), {"a": 0.5, "c": 0.5}) == "c"
    with pytest.raises(ValueError):
        next_tenant((), {})


async def _serve(share: FairShare, demands: dict[str, tuple[float, int]], grants: int) -> list[str]:
    """Each tenant queues its groups (1 sample each) at once; a "generator" ends the oldest group in flight each
    time one is granted. Returns the tenants in grant order after the first ``capacity`` (taken before the
    contention starts)."""
    order: list[str] = []
    in_flight: collections.deque[str] = collections.deque()

    async def group(tenant: str, weight: float) -> None:
        await share.acquire(tenant, weight, 1)
        order.append(tenant)
        in_flight.append(tenant)

    tasks = [asyncio.create_task(group(t, w)) for t, (w, count) in demands.items() for _ in range(count)]
    await asyncio.sleep(0)  # every group has queued (or taken free capacity)
    while len(order) < grants + share.capacity:
        share.release(in_flight.popleft(), 1)
        await asyncio.sleep(0)  # the granted group records itself
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order[share.capacity:]


@pytest.mark.parametrize("capacity", [1, 2, 4, 16])
async def test_under_contention_grants_follow_the_weights_whatever_the_capacity(capacity):
    order = await _serve(FairShare(capacity), {"a": (3.0, 200), "b": (1.0, 200)}, 100)
    counts = collections.Counter(order)
    assert counts["a"] == pytest.approx(75, abs=2) and counts["b"] == pytest.approx(25, abs=2)


async def test_an_idle_tenant_banks_no_credit():
    share = FairShare(1)
    for _ in range(10):  # b alone for a while: its virtual time runs ahead
        await share.acquire("b", 1.0, 1)
        share.release("b", 1)
    await share.acquire("a", 1.0, 1)  # a arrives: it starts at the system's virtual time, not at 0
    order = []

    async def group(tenant):
        await share.acquire(tenant, 1.0, 1)
        order.append(tenant)

    tasks = [asyncio.create_task(group(t)) for t in ("b", "a", "b", "a")]
    await asyncio.sleep(0)
    for _ in range(4):
        share.release(order[-1] if order else "a", 1)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["b", "a", "b", "a"]  # they alternate: a's ten idle rounds bought it nothing


async def test_a_tenant_alone_takes_all_the_capacity_and_a_newcomer_goes_first():
    share = FairShare(4)
    for _ in range(4):
        await share.acquire("a", 1.0, 1)  # over any share: nobody else has work
    assert share.held("a") == 4 and not share.has_room(1)
    later = asyncio.create_task(share.acquire("a", 1.0, 1))
    newcomer = asyncio.create_task(share.acquire("b", 1.0, 1))
    await asyncio.sleep(0)
    assert share.queued("a") == 1 and share.queued("b") == 1
    share.release("a", 1)
    await asyncio.sleep(0)
    assert newcomer.done() and not later.done()  # b holds nothing: it goes before a's next group
    share.release("a", 1)
    await later


async def test_a_cancelled_wait_takes_nothing_and_a_group_larger_than_capacity_goes_alone():
    share = FairShare(2)
    await share.acquire("a", 1.0, 2)
    waiting = asyncio.create_task(share.acquire("b", 1.0, 1))
    big = asyncio.create_task(share.acquire("c", 1.0, 5))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert share.queued("b") == 0 and share.held("b") == 0
    share.release("a", 2)
    await big  # nothing else in flight: it goes alone
    assert share.in_flight == 5


async def test_share_leases_give_back_once_and_all_at_close():
    share = FairShare(4)
    leases = ShareLeases(share, "run", 1.0, samples_per_group=2)
    await leases.take(0)
    await leases.take(0)  # held already: nothing more taken
    await leases.take(1)
    assert share.in_flight == 4 and not leases.has_room()
    leases.give_back((0, 0, 7))
    assert share.in_flight == 2
    leases.close()
    assert share.in_flight == 0


async def test_unbounded_capacity_never_waits():
    share = FairShare(None)
    await asyncio.gather(*(share.acquire(str(i % 3), 1.0, 8) for i in range(100)))
    assert share.in_flight == 800 and share.has_room(10**6)

"""The sandbox's slots shared between tenants (services/scorer/sandbox/slots.py): who gets a freed slot, the
per-tenant cap, and cancellations that neither leak nor lose a slot. Order is observed through events: each holder
records when it got its slot and holds it until the test releases it."""

from __future__ import annotations

import asyncio

import pytest

from services.scorer.sandbox.slots import FairSlots


class Holders:
    """Calls that take a slot for a tenant, record the order they got it in, and hold it until released."""

    def __init__(self, slots: FairSlots) -> None:
        self.slots = slots
        self.order: list[str] = []
        self._release: dict[str, asyncio.Event] = {}
        self._got: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str) -> asyncio.Task:
        """``name`` is ``<tenant><n>``, e.g. ``a1``."""
        self._release[name], self._got[name] = asyncio.Event(), asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._hold(name))
        return self.tasks[name]

    async def _hold(self, name: str) -> None:
        async with self.slots.hold(name[0]):
            self.order.append(name)
            self._got[name].set()
            await self._release[name].wait()

    async def got(self, name: str) -> None:
        async with asyncio.timeout(5):
            await self._got[name].wait()

    async def release(self, name: str) -> None:
        self._release[name].set()
        await self.tasks[name]

    async def close(self) -> None:
        """Cancel every call still waiting or holding, wait for each to end, and check each ended cleanly."""
        for task in self.tasks.values():
            task.cancel()
        results = await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results

    async def settle(self) -> None:
        """Let every task that can run, run (the slots grant synchronously on release)."""
        for _ in range(5):
            await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_tenant_with_fewest_runs_not_the_oldest_waiter():
    holders = Holders(FairSlots(2))
    for name in ("a1", "a2"):
        holders.start(name)
        await holders.got(name)
    for name in ("a3", "a4", "b1", "c1"):  # a's backlog queued first, then b and c
        holders.start(name)
    await holders.settle()
    assert holders.slots.waiting("a") == 2 and holders.slots.waiting("b") == 1
    await holders.release("a1")
    await holders.got("b1")  # a holds one, b and c none: b (never served, its waiter before c's), not a's backlog
    await holders.release("a2")
    await holders.got("c1")  # a, b, c hold 0, 1, 0: a and c tie, and c was never served
    await holders.release("b1")
    await holders.got("a3")  # a holds none, c one
    assert holders.order == ["a1", "a2", "b1", "c1", "a3"]
    await holders.close()


async def test_a_tenant_whose_run_just_ended_does_not_go_before_one_waiting_behind_its_backlog():
    holders = Holders(FairSlots(1))
    holders.start("a1")
    await holders.got("a1")
    for name in ("a2", "a3", "b1"):
        holders.start(name)
    await holders.settle()
    await holders.release("a1")  # a and b both hold none now: a was just served, b never
    await holders.got("b1")
    await holders.release("b1")
    await holders.got("a2")
    assert holders.order == ["a1", "b1", "a2"]
    await holders.close()


async def test_ties_go_round_robin_then_to_the_oldest_waiter():
    holders = Holders(FairSlots(1))
    holders.start("a1")
    await holders.got("a1")
    for name in ("b1", "c1", "b2"):
        holders.start(name)
    await holders.settle()
    await holders.release("a1")
    await holders.got("b1")  # a's slot: a has none waiting; b and c never served: b's waiter came first
    await holders.release("b1")  # b and c hold none again: c, not served yet, before b, just served
    await holders.got("c1")
    await holders.release("c1")
    await holders.got("b2")
    assert holders.order == ["a1", "b1", "c1", "b2"]
    await holders.close()


async def test_a_tenant_alone_gets_every_slot_unless_capped():
    alone = Holders(FairSlots(3))
    for name in ("a1", "a2", "a3"):
        alone.start(name)
        await alone.got(name)
    assert alone.slots.running("a") == 3
    capped = Holders(FairSlots(3, max_per_tenant=2))
    for name in ("a1", "a2", "a3", "b1"):
        capped.start(name)
    await capped.got("b1")  # the slot a may not take waits for another tenant: b never waits for a's runs
    await capped.settle()
    assert capped.order == ["a1", "a2", "b1"] and capped.slots.waiting("a") == 1
    await capped.release("a1")
    await capped.got("a3")
    await alone.close()
    await capped.close()


async def test_a_cancelled_waiter_leaves_its_queue():
    holders = Holders(FairSlots(1))
    holders.start("a1")
    await holders.got("a1")
    waiting = holders.start("b1")
    holders.start("c1")
    await holders.settle()
    waiting.cancel()  # b1 gives up while it waits
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert holders.slots.waiting("b") == 0 and holders.slots.waiting("c") == 1
    await holders.release("a1")
    await holders.got("c1")
    assert holders.order == ["a1", "c1"]
    await holders.release("c1")
    assert holders.slots.running("b") == 0


async def test_a_waiter_cancelled_just_after_its_grant_passes_the_slot_on():
    slots = FairSlots(1)
    holders = Holders(slots)
    held = slots.hold("a")
    await held.__aenter__()
    granted = holders.start("c1")
    holders.start("d1")
    await holders.settle()
    await held.__aexit__(None, None, None)  # releases without yielding: c1 is granted but has not run yet
    granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await granted
    await holders.got("d1")
    assert holders.order == ["d1"] and slots.running("c") == 0
    await holders.release("d1")
    holders.start("e1")
    await holders.got("e1")  # no slot was lost
    await holders.release("e1")


async def test_a_tenant_with_a_backlog_is_not_starved_by_tenants_that_call_one_at_a_time():
    # l and m each have one call at a time (a tool call per model turn); x a backlog. Each tenant's last grant is
    # remembered while it is idle: m, back after its first call, ranks behind x, whose last grant is older
    holders = Holders(FairSlots(1))
    holders.start("x1")
    await holders.got("x1")
    holders.start("x2")
    holders.start("x3")
    holders.start("l1")
    await holders.settle()
    await holders.release("x1")
    await holders.got("l1")  # never served, before x
    await holders.release("l1")
    await holders.got("x2")
    holders.start("m1")
    await holders.settle()
    holders.start("l2")
    await holders.settle()
    await holders.release("x2")
    await holders.got("m1")  # never served
    await holders.release("m1")
    await holders.got("l2")  # l's last grant (l1) is older than x's (x2)
    holders.start("m2")
    await holders.settle()
    await holders.release("l2")
    await holders.got("x3")  # x's last grant (x2) is older than m's (m1): m, idle in between, does not go first
    assert holders.order == ["x1", "l1", "x2", "m1", "l2", "x3"]
    await holders.close()


async def test_a_waiter_cancelled_in_the_same_turn_as_a_release_is_passed_over_and_no_slot_is_lost():
    slots = FairSlots(1)
    holders = Holders(slots)
    held = slots.hold("a")
    await held.__aenter__()
    cancelled = holders.start("b1")
    holders.start("c1")
    await holders.settle()
    cancelled.cancel()  # b1's future is cancelled now; its own handler runs on a later turn
    await held.__aexit__(None, None, None)  # the release in between: b1 is passed over, c1 granted
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await holders.got("c1")
    assert holders.order == ["c1"] and slots.waiting("b") == 0 and slots.running("b") == 0
    await holders.release("c1")
    holders.start("d1")
    await holders.got("d1")  # the slot is free again
    await holders.close()


def test_capacity_and_cap_must_be_positive():
    with pytest.raises(ValueError, match="capacity 0"):
        FairSlots(0)
    with pytest.raises(ValueError, match="max_per_tenant 0"):
        FairSlots(2, max_per_tenant=0)


def test_the_experience_service_keys_episodes_as_it_keys_the_generators_share():
    from fastexp.rl.advantages import get_estimator
    from fastexp.sampling import SamplingOptions
    from services.common.identity import caller_of
    from services.experience.api.servicer import tenant_key
    from services.experience.config import ExperienceConfig, ExperienceRequest
    from services.experience.pipeline.episodes import tenant_of

    def request(tenant: str, request_id: str = "req-1") -> ExperienceRequest:
        return ExperienceRequest(request_id, (), SamplingOptions(), ExperienceConfig(2, get_estimator("rloo")), tenant=tenant)

    alice, bob = caller_of(b"alice-token", admin=False), caller_of(b"bob-token", admin=False)
    run = object()  # a created run's record
    assert tenant_of(request(tenant_key("run-a", run, alice, "r1"))) == "run:run-a" == tenant_key("run-a", run, bob, "r2")
    # a run id nobody created, and a request without one, are each caller's own, as statistics are
    assert tenant_key("run-x", None, alice, "r1") != tenant_key("run-x", None, bob, "r1")
    assert tenant_key("", None, alice, "r1") != tenant_key("", None, bob, "r1") != tenant_key("", None, bob, "r2")
    # no request id names a run's share, whatever a caller picks
    assert tenant_key("", None, alice, "run:run-a") != tenant_key("run-a", run, alice, "r1")
    assert tenant_of(request("", request_id="req-1")) == "request:req-1"  # in process: the request's own
    long = tenant_of(request(tenant_key("é" * 200, run, alice, "r1")))  # 400 bytes: past the field's 256
    assert len(long) == 64 and long == tenant_of(request(tenant_key("é" * 200, run, bob, "r2")))

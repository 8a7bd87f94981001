"""Generator capacity shared by weighted fair share among the runs with work.

Every group a stream sends to the generator first takes ``n_samples_per_prompt`` samples of the service's capacity
(``max_samples_in_flight``) and gives them back as soon as its generation is over (its samples are in, its episodes
ended, or it failed or was cancelled) — not when it is streamed, so a slow trainer holds only its own window and
no circular wait can form between streams. While capacity is free a group goes at once, whatever its run's share
(work-conserving); when it is full, groups queue per *tenant* (a run id, else the stream's request id) and freed
capacity goes by start-time fair queueing (Goyal, Vin & Cheng 1996, SIGCOMM; weighted fair queueing's
virtual-time form): each tenant has a virtual time that a granted group advances by ``samples / weight``, the
waiting tenant with the lowest virtual time goes next, and a tenant that becomes active again starts at the system's
virtual time (the start tag of the last group granted), so it neither banks credit while idle nor waits behind
the others' history. Over any stretch where several tenants have work, their granted samples follow their weights,
whatever the capacity; a run over its share waits and none starves. Within a tenant, groups go in arrival order.
:func:`next_tenant` is the decision, pure; :class:`FairShare` holds the state, with one writer.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def next_tenant(waiting: Sequence[str], virtual: Mapping[str, float]) -> str:
    """The tenant whose oldest waiting group goes next: the lowest virtual time among ``waiting`` (tenants with a
    group queued, in the order their first waiting group arrived; ties go to the earlier).

    Raises:
        ValueError: nobody is waiting.
    """
    if not waiting:
        raise ValueError("no tenant is waiting")
    return min(waiting, key=lambda tenant: virtual[tenant])


@dataclass
class _Waiter:
    samples: int
    weight: float
    granted: asyncio.Future[None]


class FairShare:
    """The service's generator capacity in samples (module docs); ``capacity`` None: unbounded, every group goes
    at once (one tenant per deployment needs no sharing)."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"max_samples_in_flight must be >= 1, got {capacity}")
        self.capacity = capacity
        self._held: collections.Counter[str] = collections.Counter()
        self._groups: collections.Counter[str] = collections.Counter()  # groups holding capacity, per tenant
        self._virtual: dict[str, float] = {}  # each tenant's virtual time (module docs)
        self._system_virtual = 0.0  # the start tag of the last group granted
        self._queues: dict[str, collections.deque[_Waiter]] = {}  # insertion order = arrival of the first waiter

    @property
    def in_flight(self) -> int:
        """Samples held now, over every tenant."""
        return sum(self._held.values())

    def held(self, tenant: str) -> int:
        """Samples ``tenant`` holds now."""
        return self._held[tenant]

    def groups_in_flight(self, tenant: str) -> int:
        """Groups of ``tenant`` holding capacity now (generating)."""
        return self._groups[tenant]

    def queued(self, tenant: str) -> int:
        """Groups of ``tenant`` waiting for capacity now."""
        return len(self._queues.get(tenant, ()))

    def has_room(self, samples: int) -> bool:
        """Whether :meth:`acquire` of ``samples`` would return at once (room, and nobody waiting before it)."""
        return self.capacity is None or (not self._queues and self.in_flight + samples <= self.capacity)

    async def acquire(self, tenant: str, weight: float, samples: int) -> None:
        """Wait for ``samples`` of capacity for one of ``tenant``'s groups (``weight`` > 0: its share's weight).

        A group larger than the whole capacity goes alone once nothing else is in flight. Cancelling the wait
        gives nothing back (nothing was taken).
        """
        if weight <= 0:
            raise ValueError(f"a tenant's weight must be > 0, got {weight}")
        if not self._held[tenant] and tenant not in self._queues:  # (re)activated: no credit banked while idle
            self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), self._system_virtual)
        if self.has_room(samples):
            self._grant(tenant, samples, weight)
            return
        waiter = _Waiter(samples, weight, asyncio.get_running_loop().create_future())
        self._queues.setdefault(tenant, collections.deque()).append(waiter)
        self._dispatch()  # the newcomer may be the one that goes next, and fit
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():  # granted as it was cancelled: give back
                self.release(tenant, samples)
            else:
                self._forget(tenant, waiter)
            raise

    def release(self, tenant: str, samples: int) -> None:
        """``tenant``'s group's generation is over: its samples go to the groups waiting, fairly."""
        self._held[tenant] -= samples
        self._groups[tenant] -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant], self._groups[tenant]
        self._dispatch()

    def _grant(self, tenant: str, samples: int, weight: float) -> None:
        self._system_virtual = self._virtual[tenant]
        self._virtual[tenant] += samples / weight
        self._held[tenant] += samples
        self._groups[tenant] += 1

    def _dispatch(self) -> None:
        """Grant waiting groups while capacity allows, each time to :func:`next_tenant`."""
        while self._queues:
            tenant = next_tenant(tuple(self._queues), self._virtual)
            waiter = self._queues[tenant][0]
            capacity = self.capacity if self.capacity is not None else self.in_flight + waiter.samples
            if self.in_flight > 0 and self.in_flight + waiter.samples > capacity:
                return
            self._queues[tenant].popleft()
            if not self._queues[tenant]:
                del self._queues[tenant]
            self._grant(tenant, waiter.samples, waiter.weight)
            waiter.granted.set_result(None)

    def _forget(self, tenant: str, waiter: _Waiter) -> None:
        queue = self._queues.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[tenant]
        self._dispatch()  # the head of the line may have changed


class ShareLeases:
    """One stream's groups' hold on the :class:`FairShare`, by prompt index: taken before a group is sent to the
    generator, given back once (idempotent) when its generation is over, and all at once when the stream ends."""

    def __init__(self, share: FairShare, tenant: str, weight: float, samples_per_group: int) -> None:
        self._share, self.tenant, self._weight, self._samples = share, tenant, weight, samples_per_group
        self._held: set[int] = set()

    def has_room(self) -> bool:
        """Whether :meth:`take` would return at once."""
        return self._share.has_room(self._samples)

    async def take(self, prompt_index: int) -> None:
        """Wait for the group's samples of capacity (a group holding them already keeps them)."""
        if prompt_index in self._held:
            return
        await self._share.acquire(self.tenant, self._weight, self._samples)
        self._held.add(prompt_index)

    def give_back(self, prompt_indices: Iterable[int]) -> None:
        """These groups' generation is over (indices without a hold are skipped)."""
        for index in set(prompt_indices) & self._held:
            self._held.discard(index)
            self._share.release(self.tenant, self._samples)

    def close(self) -> None:
        """The stream is over: every hold still taken is given back."""
        self.give_back(tuple(self._held))

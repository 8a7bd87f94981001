"""A sandbox's run slots, shared fairly between tenants.

A local backend runs at most ``capacity`` tool programs at once; more wait. One queue for everyone would let a single
tenant (an experience run, ``StartEpisodeRequest.tenant``) with many episodes in flight hold every slot and make
another tenant's call wait behind its whole backlog. Here each tenant waits in a queue of its own and a freed slot
goes to the waiting tenant with the **fewest runs in progress**; among those, to the one **served longest ago**
(then the oldest waiter first): round robin between equally served tenants, first come first served within a
tenant. That is max-min fairness over a fixed pool, as a processor-sharing scheduler (Linux's fair group scheduling,
Kubernetes' API Priority and Fairness queues) gives it. When each tenant was last served is remembered for the
:data:`MAX_REMEMBERED` most recently served (an older one ranks as never served: before all of them, as it was).

A tenant alone still gets every slot (the pool is work-conserving) unless ``max_per_tenant`` caps it, which keeps
slots free for tenants that come later: a newcomer then waits for no other tenant's runs to end as long as the
others, each at most at its cap, hold fewer than ``capacity`` slots (one busy tenant and ``max_per_tenant`` below
``capacity``, say).

A waiter cancelled before it is granted a slot leaves its queue (one cancelled in the same turn of the event loop as
a grant is passed over); one cancelled just after its grant passes the slot on. Single event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator

logger = logging.getLogger(__name__)

#: How many tenants' last grant is remembered (the most recently served; a tenant past it ranks as never served).
MAX_REMEMBERED = 4096


class FairSlots:
    """``capacity`` slots shared between tenants (module docs); ``max_per_tenant`` (``None``: ``capacity``) the
    most one tenant holds at once.

    Raises:
        ValueError: ``capacity`` or ``max_per_tenant`` below 1.
    """

    def __init__(self, capacity: int, max_per_tenant: int | None = None) -> None:
        if capacity < 1 or (max_per_tenant is not None and max_per_tenant < 1):
            raise ValueError(f"slots: capacity {capacity} and max_per_tenant {max_per_tenant} must be >= 1")
        self._free = capacity
        self._max_per_tenant = min(capacity, max_per_tenant or capacity)
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._served: dict[str, int] = {}  # tenant -> the number of its last grant, oldest grant first
        self._tickets = itertools.count()
        self._grants = itertools.count()

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        """Wait for a slot for ``tenant`` and hold it for the ``async with`` block."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release(tenant)

    def running(self, tenant: str) -> int:
        """Slots ``tenant`` holds now."""
        return self._running.get(tenant, 0)

    def waiting(self, tenant: str) -> int:
        """Calls of ``tenant`` waiting for a slot now."""
        return len(self._waiting.get(tenant, ()))

    async def _acquire(self, tenant: str) -> None:
        if tenant not in self._waiting and self._may_take(tenant):
            self._take(tenant)
            return
        entry = (next(self._tickets), asyncio.get_running_loop().create_future())
        self._waiting.setdefault(tenant, deque()).append(entry)
        logger.debug("tenant %r waits for a sandbox slot: %d of its runs in progress, %d waiting, %d slots free",
                     tenant, self.running(tenant), self.waiting(tenant), self._free)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted as it was cancelled: pass the slot on
                self._release(tenant)
            else:
                self._leave(tenant, entry)
            raise

    def _may_take(self, tenant: str) -> bool:
        return self._free > 0 and self.running(tenant) < self._max_per_tenant

    def _take(self, tenant: str) -> None:
        self._free -= 1
        self._running[tenant] = self.running(tenant) + 1
        self._served.pop(tenant, None)  # re-inserted last: the dict stays ordered by grant
        self._served[tenant] = next(self._grants)
        if len(self._served) > MAX_REMEMBERED:
            del self._served[next(iter(self._served))]

    def _release(self, tenant: str) -> None:
        self._free += 1
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._grant()

    def _leave(self, tenant: str, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A cancelled waiter leaves its queue (unless :meth:`_grant` passed over it already)."""
        queue = self._waiting.get(tenant)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self._waiting[tenant]
        self._grant()  # it may have been the head that kept its tenant first in line

    def _grant(self) -> None:
        """Give free slots to waiters: the fewest runs in progress first, then the one served longest ago, then the
        oldest waiter. Waiters cancelled but not yet resumed (their futures are done) are passed over."""
        while self._free > 0:
            for tenant in list(self._waiting):
                queue = self._waiting[tenant]
                while queue and queue[0][1].done():
                    queue.popleft()
                if not queue:
                    del self._waiting[tenant]
            eligible = [t for t in self._waiting if self._may_take(t)]
            if not eligible:
                return
            tenant = min(eligible, key=lambda t: (self.running(t), self._served.get(t, -1), self._waiting[t][0][0]))
            queue = self._waiting[tenant]
            _, future = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            self._take(tenant)
            future.set_result(None)

"""The cores of a CPU host that a generator's engine and this service's forward passes share.

On a host without an accelerator both run on the same cores: the engine decodes, the forwards compute log-probs
of finished groups. Split once, each would idle its half while the other has the work (generation before the
first group is scored, forwards after the last token). :class:`CoreShare` moves the cores to the work instead:

- a forward pass waits or runs: the engine runs on ``engine_threads_sharing`` threads (``SetCpuThreads``) and the
  pass on ``forward_threads``, so together they fill the cores without oversubscribing them;
- no forward pass waits: the engine runs on every core it is bound to;
- no generation in flight: a pass runs on ``idle_forward_threads`` (every core).

The engine is shrunk before a pass starts (the call returns once its next step runs on fewer threads) and grown
back, in the background, once no pass waits. Only generators that report adjustable threads take part (vLLM on
CPU: ``ModelInfo.max_cpu_threads`` > 0; an accelerator's engine, the HF backend or an older server reports 0), so
the same settings are right on a GPU host, where nothing changes. A generator that restarts comes back on every
bound core; it is shrunk again at the next pass after the forwards went idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from services.common import metrics
from services.common.errors import FastexpError

if TYPE_CHECKING:
    from services.experience.fleet.generator_fleet import GeneratorFleet

logger = logging.getLogger(__name__)


class CoreShare:
    """Owner of the threads of the forward passes and of the engines they share the host with (module docs).

    ``engine_threads_sharing``: the engines' threads while a pass waits or runs (0: engines are left as they are);
    ``forward_threads``: a pass's threads while generation is in flight (None: torch's setting);
    ``idle_forward_threads``: a pass's threads while none is (None: ``forward_threads``); ``timeout_s``: the
    deadline of each ``SetCpuThreads`` call.
    """

    def __init__(self, fleet: GeneratorFleet, *, engine_threads_sharing: int = 0, forward_threads: int | None = None,
                 idle_forward_threads: int | None = None, timeout_s: float = 5.0) -> None:
        self._fleet = fleet
        self._sharing = engine_threads_sharing
        self._busy = forward_threads
        self._idle = idle_forward_threads if idle_forward_threads is not None else forward_threads
        self._timeout_s = timeout_s
        self._pending = 0  # forward passes waiting for the models or running
        self._applied: dict[str, int] = {}  # replica address → threads last set there (0: every bound core)
        self._changing = asyncio.Lock()  # one reconciliation at a time
        self._growing: asyncio.Task | None = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count a forward pass from before it waits for the models until it ends; the last one out lends the
        engines every core again (in the background)."""
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1
            if self._pending == 0 and self._sharing and (self._growing is None or self._growing.done()):
                self._growing = asyncio.get_running_loop().create_task(self._reconcile())

    async def threads(self) -> int | None:
        """The threads of the pass about to start (inside :meth:`waiting`), once the engines run on their share."""
        if self._sharing:
            await self._reconcile()
        return self._idle if self._fleet.samples_in_flight() == 0 else self._busy

    def shared(self) -> bool:
        """Whether some serving engine's threads are adjusted for the passes (module docs)."""
        return bool(self._sharing) and any(replica.info is not None and replica.info.max_cpu_threads > 0
                                           for replica in self._fleet.replicas)

    async def close(self) -> None:
        """Stop a background change (the engines keep the threads they have)."""
        if self._growing is not None:
            self._growing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._growing

    async def _reconcile(self) -> None:
        """Set every adjustable serving engine to the threads the forwards' state asks for, until it holds."""
        async with self._changing:
            while True:
                wanted = self._sharing if self._pending else 0
                stale = [replica for replica in self._fleet.replicas
                         if replica.info is not None and replica.info.max_cpu_threads > 0
                         and self._fleet.members.routable(replica) and self._applied.get(replica.address) != wanted]
                if not stale:
                    return
                await asyncio.gather(*(self._set(replica, wanted) for replica in stale))

    async def _set(self, replica, threads: int) -> None:
        """One engine's threads (a failure is logged and left for the next change: the pass runs regardless)."""
        try:
            applied = await replica.client.set_cpu_threads(threads, self._timeout_s)
        except FastexpError as error:
            logger.info("generator %s kept its threads: %s", replica.address, error)
            self._applied[replica.address] = threads  # not again before the forwards' state changes
            return
        self._applied[replica.address] = threads
        metrics.ENGINE_THREAD_CHANGES.labels("shared" if threads else "all").inc()
        logger.debug("generator %s runs on %d threads", replica.address, applied)

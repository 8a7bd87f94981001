"""The policy versions the experience service serves, and the waits built on them (off-policy admission, aborts).

One :class:`VersionClock` for the base policy per service, and one per LoRA run's adapter (:class:`PolicyClocks`),
touched only from its event loop. A run's ``max_staleness`` and ``partial_rollout`` follow its own clock: an update
to one run's adapter neither aborts nor admits another run's groups. The version is the generator's (the
experience service forwards every policy update and then copies it into its actor replica, so both serve the
same weights under the same number). Streams wait on it: with ``max_staleness`` a batch waits until the trainer
has moved the policy far enough (:meth:`wait_for_version`), and with partial rollouts set to abort, in-flight
generation stops as soon as an update begins (:meth:`update_begun`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.deadlines import Deadline
from services.common.errors import UpstreamTimeout


class VersionClock:
    """``version``: the policy version live on the generator and the actor replica; ``updating``: an update is
    being applied (between :meth:`begin_update` and :meth:`end_update`)."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.updating = False
        self._changed = asyncio.Condition()
        self._update_begun = asyncio.Event()

    async def begin_update(self) -> None:
        """Mark an update in progress and fire :meth:`update_begun` (aborting partial rollouts stop now)."""
        async with self._changed:
            self.updating = True
            self._update_begun.set()
            self._update_begun = asyncio.Event()
            self._changed.notify_all()

    async def end_update(self, version: int | None) -> None:
        """End the update: ``version`` is now live (``None``: it failed, the old version stays); wake waiters."""
        async with self._changed:
            self.updating = False
            if version is not None:
                self.version = version
            self._changed.notify_all()

    def update_begun(self) -> asyncio.Event:
        """An event set when the next update begins (take it before starting work an update should abort)."""
        return self._update_begun

    async def wait_idle(self, deadline: Deadline) -> None:
        """Return once no update is in progress.

        Raises:
            UpstreamTimeout: the request's deadline passed first.
        """
        await self._wait(lambda: not self.updating, deadline, "the running weight update to finish")

    async def wait_for_version(self, version: int, deadline: Deadline) -> None:
        """Return once ``self.version >= version`` and no update is in progress.

        Raises:
            UpstreamTimeout: the deadline passed first (the trainer did not update the policy in time).
        """
        await self._wait(
            lambda: self.version >= version and not self.updating, deadline,
            f"policy version {version} (now {self.version}; max_staleness waits for the trainer's UpdateWeights)",
        )

    async def _wait(self, ready: Callable[[], bool], deadline: Deadline, what: str) -> None:
        async with self._changed:
            try:
                async with asyncio.timeout(deadline.remaining()):
                    await self._changed.wait_for(ready)
            except TimeoutError:
                raise UpstreamTimeout(f"deadline exceeded waiting for {what}") from None


class PolicyClocks:
    """The base policy's clock and each LoRA run's adapter clock, by adapter name (a run id). An adapter's clock
    is at 0 until its first update is live (its run has no policy to sample yet)."""

    def __init__(self, base: VersionClock | None = None) -> None:
        self.base = base if base is not None else VersionClock()
        self._adapters: dict[str, VersionClock] = {}

    def of(self, adapter: str | None) -> VersionClock:
        """The clock of ``adapter`` (None: the base policy's), made at version 0 on first use."""
        if adapter is None:
            return self.base
        return self._adapters.setdefault(adapter, VersionClock())

    def live_adapters(self) -> dict[str, int]:
        """Every adapter with a version live (at least 1): name → version (safe from the metrics thread: it reads a
        copy of the clocks taken at once)."""
        return {name: clock.version for name, clock in list(self._adapters.items()) if clock.version > 0}

    def settled_adapters(self) -> dict[str, int]:
        """The live adapters no update is being applied to: name → version. What a generator replica must hold to
        serve: while one is updated a replica may already hold its next version, and is not taken out for it."""
        return {name: clock.version for name, clock in list(self._adapters.items())
                if clock.version > 0 and not clock.updating}

    def forget(self, adapter: str) -> None:
        """Drop ``adapter``'s clock (its run was deleted; a run of that name later starts again at 0)."""
        self._adapters.pop(adapter, None)

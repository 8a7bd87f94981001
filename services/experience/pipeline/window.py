"""A stream's backpressure window: one lease per prompt group, from the group's admission to its end.

The producer takes a lease for a prompt before it sends it to the generator (:meth:`Window.lease`), so at most
``size`` groups of a stream are generating or waiting to be streamed. A lease ends exactly once, when its group is
done: streamed to the trainer or abandoned after a failure (the consumer), dropped by dynamic sampling or failed
in its environment (the producer, as it reports it), and at the latest when the stream ends for any reason
(:meth:`Window.close`: the stream finished, failed, or was cancelled mid-flight, e.g. by a trainer that hung up).
A group generated again (resampled as too stale, aborted by an update, rerouted from a failed replica) keeps its
lease. Leases are kept by prompt index, so ending one twice, or one never taken, changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class Window:
    """The leases of one stream's groups (module docs); ``size``: the most held at once (``None``: unbounded)."""

    def __init__(self, size: int | None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"a window holds at least one group, got {size}")
        self.size = size
        self._slots = asyncio.Semaphore(size) if size is not None else None
        self._held: set[int] = set()
        self._closed = False

    @property
    def held(self) -> frozenset[int]:
        """The prompt indices whose groups hold a lease now."""
        return frozenset(self._held)

    def has_room(self) -> bool:
        """Whether :meth:`lease` would return at once."""
        return self._slots is None or not self._slots.locked()

    async def lease(self, prompt_index: int) -> None:
        """Wait for a free slot, then hold it for ``prompt_index``'s group until :meth:`end` or :meth:`close`.

        Raises:
            ValueError: the group holds a lease already (a resampled group keeps the one it has).
            RuntimeError: the window was closed (its stream is over).
        """
        if prompt_index in self._held:
            raise ValueError(f"prompt {prompt_index} holds a window slot already")
        if self._slots is not None:
            await self._slots.acquire()
        if self._closed:  # closed while waiting: the slot goes back at once
            if self._slots is not None:
                self._slots.release()
            raise RuntimeError("the stream's window is closed")
        self._held.add(prompt_index)

    def end(self, prompt_indices: Iterable[int]) -> int:
        """These groups are done: their leases end and admit the next prompts. Indices without a lease (ended
        before, or repeated) are skipped; returns how many leases ended."""
        ended = 0
        for index in set(prompt_indices) & self._held:
            self._held.discard(index)
            if self._slots is not None:
                self._slots.release()
            ended += 1
        return ended

    def close(self) -> int:
        """The stream is over: every lease still held ends, and no new one is given. Returns how many ended."""
        self._closed = True
        return self.end(tuple(self._held))

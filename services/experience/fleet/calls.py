"""One ``GeneratorFleet.generate`` call's state: its groups (pending, on a replica, whole) and its sub-streams, one
per replica used, whose records and ends arrive on the call's event queue."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.deadlines import Deadline
from services.common.errors import NotReady
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.fleet.replicas import Replica
from services.experience.fleet.routing import GroupWork


@dataclass(eq=False)
class SubStream:
    """The part of one ``generate`` call sent to one replica."""

    replica: Replica
    indices: tuple[int, ...]  # the call's prompt indices, in the order sent
    reserved_tokens: int
    max_tokens: int
    samples_left: int
    task: asyncio.Task[BaseException | None] | None = None  # reads the replica's stream; returns its error
    taken_out: str | None = None  # why its replica was taken out (then its groups are rerouted)
    released_tokens: int = 0

    def stop(self, reason: str) -> None:
        """Its replica was taken out: stop reading; its unfinished groups are rerouted."""
        if self.taken_out is None and self.task is not None:
            self.taken_out = reason
            self.task.cancel()


def taken_out_error(stream: SubStream) -> NotReady:
    """The error that ends ``stream`` once its replica was taken out (its groups are rerouted)."""
    return NotReady(f"generator {stream.replica.address} taken out: {stream.taken_out}")


def queue_end(stream: SubStream, events: asyncio.Queue[Record | Ended], task: asyncio.Task[BaseException | None]) -> None:
    """The done callback of ``stream``'s task: queue its end (with the task's error, if any), since ``generate()``
    waits for every end. A task cancelled by :meth:`SubStream.stop` before its first step never ran its coroutine,
    which is why the end is queued here and not by the coroutine; a task cancelled because the call closed queues
    nothing."""
    if task.cancelled():
        if stream.taken_out is not None:
            events.put_nowait(Ended(stream, taken_out_error(stream)))
        return
    error = task.exception()
    events.put_nowait(Ended(stream, error if error is not None else task.result()))


@dataclass(frozen=True)
class Record:
    stream: SubStream
    record: CompletionRecord


@dataclass(frozen=True)
class Ended:
    stream: SubStream
    error: BaseException | None


@dataclass(eq=False)
class Call:
    """One ``generate`` call's groups: pending (not placed), on a replica, whole (yielded)."""

    request: GenerationRequest
    deadline: Deadline
    works: list[GroupWork]
    events: asyncio.Queue[Record | Ended] = field(default_factory=asyncio.Queue)
    streams: set[SubStream] = field(default_factory=set)
    groups: dict[int, list[CompletionRecord]] = field(default_factory=dict)  # samples so far, by prompt index
    excluded: set[str] = field(default_factory=set)  # replicas that failed this call
    pending: list[int] = field(default_factory=list)
    unfinished: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.pending = list(range(len(self.request.prompts)))
        self.unfinished = set(self.pending)

    def receive(self, record: CompletionRecord) -> list[CompletionRecord]:
        """Hold ``record``; the group's n completions in sample order once it is whole, else []."""
        group = self.groups.setdefault(record.prompt_index, [])
        group.append(record)
        if len(group) < self.request.n_samples_per_prompt:
            return []
        del self.groups[record.prompt_index]
        self.unfinished.discard(record.prompt_index)
        return sorted(group, key=lambda c: c.sample_index)

    def reroute(self, lost: Sequence[int], failed: str) -> None:
        """``lost`` groups' replica failed: drop their samples so far, place them again elsewhere first."""
        for index in lost:
            self.groups.pop(index, None)
        self.pending = [*lost, *self.pending]
        self.excluded.add(failed)

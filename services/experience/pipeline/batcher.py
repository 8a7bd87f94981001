"""What the consumer holds and decides, as pure functions over an immutable :class:`Inbox` (no I/O, no tasks).

The consumer of a stream receives events (:mod:`~services.experience.pipeline.events`), forwards scored groups and delivers
batches. Each function here takes the inbox and returns a new one, so each decision — is a batch ready, which
groups are forwarded next, which groups make the next batch and which are too stale for it — is tested alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from services.common.generation import CompletionRecord
from services.experience.config import ExperienceConfig
from services.experience.pipeline.events import (
    Done,
    Dropped,
    Event,
    Failed,
    ForwardedGroup,
    GroupFailed,
    SampleFinished,
    ScoredGroup,
)


@dataclass(frozen=True)
class Inbox:
    """Scored groups waiting for a forward pass, forwarded groups waiting for a batch, finished samples of groups
    still generating (forwarded early, when nothing else is to do), dynamic-sampling drops not yet reported,
    resamples asked for and not returned, and whether more can come."""

    pending: tuple[ScoredGroup, ...] = ()
    forwarded: tuple[ForwardedGroup, ...] = ()
    finished_samples: tuple[CompletionRecord, ...] = ()  # samples of groups still generating, not yet forwarded
    dropped: tuple[int, ...] = ()
    awaiting: int = 0
    producer_done: bool = False
    failure: BaseException | None = None  # raised once the groups received before it are delivered

    @property
    def finished(self) -> bool:
        """Nothing more will arrive."""
        return self.failure is not None or (self.producer_done and self.awaiting == 0)


def receive(inbox: Inbox, event: Event) -> Inbox:
    """The inbox after ``event`` (events that only count, like ``RoundStarted``, leave it as it is)."""
    if isinstance(event, Failed):
        return dataclasses.replace(inbox, failure=inbox.failure or event.error)
    if isinstance(event, Done):
        return dataclasses.replace(inbox, producer_done=True)
    if isinstance(event, SampleFinished):
        return dataclasses.replace(inbox, finished_samples=(*inbox.finished_samples, event.completion))
    if isinstance(event, Dropped):
        return dataclasses.replace(
            inbox, dropped=(*inbox.dropped, event.prompt_index), awaiting=inbox.awaiting - event.resampled,
            finished_samples=_without_group(inbox.finished_samples, event.prompt_index),
        )
    if isinstance(event, ScoredGroup):  # its samples not forwarded early go with the group
        return dataclasses.replace(
            inbox, pending=(*inbox.pending, event), awaiting=inbox.awaiting - event.resampled,
            finished_samples=_without_group(inbox.finished_samples, event.prompt_index),
        )
    if isinstance(event, GroupFailed):  # a failed resample is no longer awaited
        return dataclasses.replace(
            inbox, awaiting=inbox.awaiting - event.resampled,
            finished_samples=_without_group(inbox.finished_samples, event.prompt_index),
        )
    return inbox


def _without_group(samples: tuple[CompletionRecord, ...], prompt_index: int) -> tuple[CompletionRecord, ...]:
    return tuple(s for s in samples if s.prompt_index != prompt_index)


class Step(Enum):
    """What the consumer does next (:func:`next_step`)."""

    DELIVER = "deliver"  # assemble and stream a batch
    FORWARD = "forward"  # run the forward passes on pending groups
    FORWARD_EARLY = "forward_early"  # run them on finished samples of groups still generating
    FINISH = "finish"  # nothing more will come
    WAIT = "wait"  # for the next event


def batch_ready(inbox: Inbox, config: ExperienceConfig) -> bool:
    """A batch can be assembled: enough forwarded groups, or the last ones (all of them for rollout scope)."""
    last = inbox.finished and not inbox.pending and bool(inbox.forwarded)
    return last or (not config.rollout_scope and len(inbox.forwarded) >= config.groups_per_batch)


def next_step(inbox: Inbox, config: ExperienceConfig) -> Step:
    """Deliver before forwarding more (the trainer is waiting), forward scored groups before samples of groups
    still generating, and those before waiting."""
    if batch_ready(inbox, config):
        return Step.DELIVER
    if inbox.pending:
        return Step.FORWARD
    if inbox.finished_samples and inbox.failure is None:
        return Step.FORWARD_EARLY
    return Step.FINISH if inbox.finished else Step.WAIT


def take_finished_samples(inbox: Inbox, max_rows: int) -> tuple[tuple[CompletionRecord, ...], Inbox]:
    """The oldest finished samples of groups still generating, at most ``max_rows`` (at least one)."""
    count = max(1, max_rows)
    return inbox.finished_samples[:count], dataclasses.replace(inbox, finished_samples=inbox.finished_samples[count:])


def take_pending(inbox: Inbox, max_rows: int, n: int) -> tuple[tuple[ScoredGroup, ...], Inbox]:
    """The oldest pending groups for one forward pass: up to ``max_rows`` rows, at least one group of ``n``."""
    count = max(1, min(len(inbox.pending), max_rows // n))
    return inbox.pending[:count], dataclasses.replace(inbox, pending=inbox.pending[count:])


def add_forwarded(inbox: Inbox, groups: tuple[ForwardedGroup, ...]) -> Inbox:
    """The inbox with ``groups`` (just forwarded) waiting for a batch, after the ones already waiting."""
    return dataclasses.replace(inbox, forwarded=(*inbox.forwarded, *groups))


@dataclass(frozen=True)
class BatchTake:
    """:func:`take_batch`'s answer: the batch's groups (empty when stale ones went back instead), the stale
    groups to generate again (``resample``) or to give up (``abandoned``, after a failure), and the new inbox."""

    groups: tuple[ForwardedGroup, ...]
    resample: tuple[ForwardedGroup, ...]
    abandoned: tuple[ForwardedGroup, ...]
    inbox: Inbox


def take_batch(inbox: Inbox, config: ExperienceConfig, oldest_version: int | None) -> BatchTake:
    """The next batch's groups (all forwarded ones with rollout scope), in arrival order.

    ``oldest_version`` (off-policy streaming with ``max_staleness``): groups sampled before it may not be
    delivered; if any are forwarded, no batch is taken now — they go back for resampling (counted as awaited),
    or, once the producer failed, are abandoned.
    """
    if oldest_version is not None:
        stale = tuple(g for g in inbox.forwarded if g.scored.policy_version < oldest_version)
        if stale:
            fresh = tuple(g for g in inbox.forwarded if g.scored.policy_version >= oldest_version)
            if inbox.failure is not None:  # cannot be resampled any more; never streamed
                return BatchTake((), (), stale, dataclasses.replace(inbox, forwarded=fresh))
            after = dataclasses.replace(inbox, forwarded=fresh, awaiting=inbox.awaiting + len(stale))
            return BatchTake((), stale, (), after)
    size = len(inbox.forwarded) if config.rollout_scope else config.groups_per_batch
    rest = dataclasses.replace(inbox, forwarded=inbox.forwarded[size:])
    return BatchTake(inbox.forwarded[:size], (), (), rest)


def reported_drops(inbox: Inbox) -> tuple[tuple[int, ...], Inbox]:
    """The dynamic-sampling drops to report with the next batch, and the inbox without them."""
    return inbox.dropped, dataclasses.replace(inbox, dropped=())

"""The producer stage: generation rounds, off-policy admission, resampling, and scoring each group as it finishes.

For one stream, :meth:`Producer.start` runs background tasks that start rounds of prompt groups and put events on
the stream's queue (:mod:`~services.experience.pipeline.events`). Which prompts a round starts, and when, is decided
by the pure functions of :mod:`~services.experience.pipeline.admission` (refill rounds for dynamic sampling, batches
admitted by policy version with ``max_staleness``); how a round's groups are sampled and scored is the request's
rollout (:mod:`~services.experience.pipeline.rollouts`: single-turn, environment episodes, agent episodes). Each
finished group is kept or dropped here (dynamic sampling drops zero-variance groups); groups the consumer finds too
stale come back through :meth:`ProducerRun.resample`; with aborting partial rollouts, groups an update interrupts
are generated again.

Backpressure: every prompt takes a lease on the stream's window (:mod:`~services.experience.pipeline.window`) before
it is sent to the generator, so at most ``max_groups_ahead`` groups are generating or waiting. The lease ends when
the group is done: the producer ends it as it reports a drop or an environment failure, the consumer once the group
is streamed or abandoned, and :meth:`ProducerRun.close` ends whatever is left, however the stream ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastexp.rl.processing import zero_variance_groups
from services.common.deadlines import Deadline
from services.common.generation import CompletionRecord
from services.experience.config import ExperienceRequest
from services.experience.pipeline import admission
from services.experience.pipeline.events import (
    Done,
    Dropped,
    Event,
    Failed,
    GroupsResampled,
    RoundStarted,
    ScoredGroup,
    Scores,
)
from services.experience.pipeline.fair_share import FairShare, ShareLeases
from services.experience.pipeline.rollouts import ROLLOUTS, RolloutParts, rollout_kind
from services.experience.pipeline.versions import PolicyClocks, VersionClock
from services.experience.pipeline.window import Window

logger = logging.getLogger(__name__)


@dataclass
class ProducerRun:
    """One stream's producer: its event queue, its backpressure window, and the tasks feeding them."""

    request: ExperienceRequest
    deadline: Deadline
    start_version: int  # v0: the policy version when the request started
    window: Window  # one lease per group generating or not yet streamed
    share: ShareLeases  # the groups' hold on the service's generator capacity while they generate
    policy: VersionClock  # the clock of the policy it samples (the base's, or its LoRA run's adapter's)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    resamples: asyncio.Queue[int] = field(default_factory=asyncio.Queue)  # prompt indices to generate again
    round_ids: itertools.count = field(default_factory=itertools.count)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def resample(self, prompt_indices: Sequence[int]) -> None:
        """Generate these prompts' groups again (they keep their window leases)."""
        for index in prompt_indices:
            self.resamples.put_nowait(index)

    async def close(self) -> None:
        """Cancel the tasks (closing their generator streams aborts the engine's unfinished samples) and end every
        window lease still held."""
        try:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            self.window.close()
            self.share.close()


class Producer:
    """Starts a :class:`ProducerRun` per stream over the parts its rollouts reach (generator, scorer, and the
    episode and agent runners where the service has them)."""

    def __init__(self, parts: RolloutParts, clocks: PolicyClocks, max_groups_ahead: int,
                 share: FairShare | None = None) -> None:
        """``clocks``: the base policy's and each LoRA run's version clocks; ``share``: the service's generator
        capacity, shared by the streams' runs (None: unbounded)."""
        self._parts = parts
        self._clocks = clocks
        self._max_groups_ahead = max_groups_ahead
        self._share = share if share is not None else FairShare(None)

    def start(self, request: ExperienceRequest, deadline: Deadline) -> ProducerRun:
        """Start producing ``request``'s groups (window: ``max_groups_ahead``, at least a batch's groups; none
        with ``normalization_scope = rollout``, which needs the whole request before its first batch)."""
        config = request.config
        bound = request.run  # a created run's window and share weight, as its record says
        ahead = bound.max_groups_ahead if bound is not None and bound.max_groups_ahead is not None else self._max_groups_ahead
        window = None if config.rollout_scope else max(ahead, config.groups_per_batch)
        share = ShareLeases(self._share, request.share_key, 1.0 if bound is None else bound.weight,
                            config.n_samples_per_prompt)
        policy = self._clocks.of(request.adapter)
        # a resumed stream counts staleness from its first open's version
        start_version = policy.version if request.stream is None else request.stream.start_version
        run = ProducerRun(request, deadline, start_version, Window(window), share, policy)
        run.tasks = [
            asyncio.create_task(self._produce(run), name=request.request_id),
            asyncio.create_task(self._resample(run), name=f"{request.request_id}-resample"),
        ]
        return run

    async def _produce(self, run: ProducerRun) -> None:
        """Generate every group once (then ``Done``); an error goes to the consumer, which raises it in order."""
        try:
            if run.request.config.max_staleness is None:
                await self._produce_rounds(run)
            else:
                await self._produce_admitted(run)
            await run.events.put(Done())
        except Exception as error:  # handed to the consumer, which delivers what is ready, then raises it
            await run.events.put(Failed(error))

    async def _produce_rounds(self, run: ProducerRun) -> None:
        """Run generation rounds until enough groups are kept (all prompts without dynamic sampling)."""
        rounds = admission.first_rounds(run.request.config, len(run.request.prompts))
        while (indices := admission.next_round(rounds)) is not None:
            await run.events.put(RoundStarted())
            rounds = admission.after_round(rounds, indices, await self._run_round(run, indices))

    async def _produce_admitted(self, run: ProducerRun) -> None:
        """Off-policy admission: batch b's prompts start generating once the policy reaches v0 + b - s, so at
        most s + 1 batches run ahead of the trainer."""
        config, stream = run.request.config, run.request.stream
        first = 0 if stream is None else stream.first_batch_index  # a resumed stream's batches go on from there
        try:
            async with asyncio.TaskGroup() as rounds:
                for batch, indices in enumerate(admission.admitted_batches(len(run.request.prompts),
                                                                           config.groups_per_batch), start=first):
                    version = admission.admission_version(run.start_version, batch, config.max_staleness or 0)
                    await run.policy.wait_for_version(version, run.deadline)
                    await run.events.put(RoundStarted())
                    rounds.create_task(self._run_round(run, indices))
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None

    async def _resample(self, run: ProducerRun) -> None:
        """Generate again the groups the consumer found too stale, as they come (runs for the whole stream)."""
        try:
            while True:
                indices = [await run.resamples.get()]
                while not run.resamples.empty():
                    indices.append(run.resamples.get_nowait())
                await self._run_round(run, indices, resampled=True)
        except Exception as error:
            await run.events.put(Failed(error))

    async def _run_round(self, run: ProducerRun, indices: Sequence[int], resampled: bool = False) -> int:
        """Generate and score ``indices``' groups; returns how many were kept.

        Each prompt takes a window lease first (backpressure; resampled groups keep the one they hold), then its
        samples of the service's generator capacity (:mod:`~services.experience.pipeline.fair_share`): the
        prompts with room now go to the generator together, the rest as leases end and capacity frees.
        """
        tasks, position = [], 0

        async def admit(index: int) -> None:
            if not resampled:
                await run.window.lease(index)
            await run.share.take(index)

        def room() -> bool:
            return (resampled or run.window.has_room()) and run.share.has_room()

        try:
            async with asyncio.TaskGroup() as slices:
                while position < len(indices):
                    await admit(indices[position])
                    count = 1
                    while position + count < len(indices) and room():
                        await admit(indices[position + count])  # room: returns at once
                        count += 1
                    part = indices[position : position + count]
                    tasks.append(slices.create_task(self._run_slice(run, part, resampled)))
                    position += count
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return sum(task.result() for task in tasks)

    async def _run_slice(self, run: ProducerRun, indices: Sequence[int], resampled: bool) -> int:
        """Generate and score ``indices``' groups; with aborting partial rollouts, groups an update interrupts
        are generated again under the new weights. Returns how many groups were kept."""
        remaining, kept = list(indices), 0
        try:
            while remaining:
                abort_on = run.policy.update_begun() if run.request.config.abort_partial_rollouts else None
                kept_now, remaining = await self._generate_round(run, remaining, abort_on, resampled)
                kept += kept_now
                if remaining:  # they keep their capacity: they are generated again after the update
                    await run.events.put(GroupsResampled(len(remaining)))
                    logger.info("%s: update began; %d unfinished groups aborted, resampled after it",
                                run.request.request_id, len(remaining))
                    await run.policy.wait_idle(run.deadline)
        finally:
            run.share.give_back(indices)  # whatever the rollout did not give back as groups finished
        return kept

    async def _generate_round(
        self, run: ProducerRun, indices: Sequence[int], abort_on: asyncio.Event | None, resampled: bool
    ) -> tuple[int, list[int]]:
        """Roll out ``indices``' groups with the request's rollout, each handed on as it finishes.

        Returns (groups kept, prompt indices left unfinished because ``abort_on`` fired first). Groups already
        complete are scored and delivered even when generation failed or was aborted.
        """
        rollout = ROLLOUTS[rollout_kind(run.request.config)](
            run, indices, self._parts, lambda group, scores: self._hand_on(run, group, scores, resampled), resampled,
        )
        generating = asyncio.create_task(rollout.consume())
        aborted = False
        try:
            aborted = await _until_done_or_aborted(generating, abort_on)
        except asyncio.CancelledError:
            generating.cancel()
            rollout.cancel()
            raise
        finally:
            results = await rollout.outcomes()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        unfinished = [i for i in indices if i not in rollout.complete] if aborted else []
        return sum(results), unfinished

    async def _hand_on(
        self, run: ProducerRun, completions: tuple[CompletionRecord, ...], scores: Scores, resampled: bool
    ) -> bool:
        """Hand a scored group to the consumer, or drop it (dynamic sampling); True when kept."""
        request, prompt_index = run.request, completions[0].prompt_index
        config = request.config
        if config.dynamic_sampling and _all_equal(scores.rewards):
            await run.events.put(Dropped(prompt_index, resampled))
            run.window.end((prompt_index,))  # never streamed: its lease admits the next prompt now
            logger.debug("%s: dropped prompt %d (all rewards equal)", request.request_id, prompt_index)
            return False
        await run.events.put(ScoredGroup(completions, scores, resampled))
        return True


async def _until_done_or_aborted(generating: asyncio.Task[None], abort_on: asyncio.Event | None) -> bool:
    """Wait for ``generating``; if ``abort_on`` fires first, cancel it (closing the generator stream aborts the
    engine's unfinished samples) and return True. Generation errors are raised."""
    if abort_on is None:
        await generating
        return False
    watcher = asyncio.create_task(abort_on.wait())
    try:
        await asyncio.wait({generating, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if generating.done():
        generating.result()
        return False
    generating.cancel()
    await asyncio.gather(generating, return_exceptions=True)
    return True


def _all_equal(rewards: torch.Tensor) -> bool:
    """Whether one group's rewards (R,) carry no signal: all equal (dynamic sampling drops such a group)."""
    return bool(zero_variance_groups(rewards, rewards.shape[0])[0])

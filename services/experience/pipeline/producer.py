"""The producer stage: generation rounds, off-policy admission, resampling, and scoring each group as it finishes.

For one stream, :meth:`Producer.start` runs background tasks that send prompts to the generator and put events on
the stream's queue (:mod:`~services.experience.pipeline.events`): each prompt group is scored as soon as its n samples are
in, while the engine keeps generating. Dynamic sampling drops zero-variance groups and starts refill rounds for
the shortfall; with ``max_staleness`` batch b's prompts start only once the policy reaches v0 + b - s (AReaL's
staleness control, arXiv 2505.24298); groups the consumer finds too stale come back through
:meth:`ProducerRun.resample`; with aborting partial rollouts, groups an update interrupts are generated again.

Backpressure: every prompt takes a lease on the stream's window (:mod:`~services.experience.pipeline.window`) before
it is sent to the generator, so at most ``max_groups_ahead`` groups are generating or waiting. The lease ends when
the group is done: the producer ends it as it reports a drop or an environment failure, the consumer once the group
is streamed or abandoned, and :meth:`ProducerRun.close` ends whatever is left, however the stream ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fastexp.rl.processing import zero_variance_groups
from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import EpisodeFailed, RewardFailed
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.config import ExperienceRequest
from services.experience.pipeline.episodes import EpisodeRunner
from services.experience.pipeline.events import (
    Done,
    Dropped,
    Event,
    Failed,
    Generator,
    GroupFailed,
    GroupsRerouted,
    GroupsResampled,
    Rerouted,
    RoundStarted,
    SampleFinished,
    SamplePreview,
    ScoreBatch,
    ScoredGroup,
    Scorer,
    Scores,
)
from services.experience.pipeline.versions import VersionClock
from services.experience.pipeline.window import Window

logger = logging.getLogger(__name__)


@dataclass
class ProducerRun:
    """One stream's producer: its event queue, its backpressure window, and the tasks feeding them."""

    request: ExperienceRequest
    deadline: Deadline
    start_version: int  # v0: the policy version when the request started
    window: Window  # one lease per group generating or not yet streamed
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


class Producer:
    """Starts a :class:`ProducerRun` per stream over one generator and scorer (and, for multi-turn requests, the
    episode runner: :mod:`~services.experience.pipeline.episodes`)."""

    def __init__(
        self, generator: Generator, scorer: Scorer, policy: VersionClock, max_groups_ahead: int,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self._generator = generator
        self._scorer = scorer
        self._policy = policy
        self._max_groups_ahead = max_groups_ahead
        self._episodes = episodes

    def start(self, request: ExperienceRequest, deadline: Deadline) -> ProducerRun:
        """Start producing ``request``'s groups (window: ``max_groups_ahead``, at least a batch's groups; none
        with ``normalization_scope = rollout``, which needs the whole request before its first batch)."""
        config = request.config
        window = None if config.rollout_scope else max(self._max_groups_ahead, config.groups_per_batch)
        run = ProducerRun(request, deadline, self._policy.version, Window(window))
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
        prompts, dynamic = run.request.prompts, run.request.config.dynamic_sampling
        target = dynamic.num_groups if dynamic else len(prompts)
        rounds_left = 1 + (dynamic.max_extra_rounds if dynamic else 0)
        next_prompt, kept = 0, 0
        while kept < target and rounds_left > 0 and next_prompt < len(prompts):
            indices = range(next_prompt, min(len(prompts), next_prompt + target - kept))
            next_prompt = indices.stop
            rounds_left -= 1
            await run.events.put(RoundStarted())
            kept += await self._run_round(run, indices)

    async def _produce_admitted(self, run: ProducerRun) -> None:
        """Off-policy admission: batch b's prompts start generating once the policy reaches v0 + b - s, so at
        most s + 1 batches run ahead of the trainer."""
        config, prompts = run.request.config, run.request.prompts
        per_batch, staleness = config.groups_per_batch, config.max_staleness or 0
        try:
            async with asyncio.TaskGroup() as rounds:
                for batch, start in enumerate(range(0, len(prompts), per_batch)):
                    await self._policy.wait_for_version(run.start_version + batch - staleness, run.deadline)
                    await run.events.put(RoundStarted())
                    rounds.create_task(self._run_round(run, range(start, min(len(prompts), start + per_batch))))
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

        Each prompt takes a window lease first (backpressure): the prompts with room now go to the generator
        together, the rest as leases end. Resampled groups keep the lease they hold.
        """
        if resampled:
            return await self._run_slice(run, indices, resampled)
        window, tasks, position = run.window, [], 0
        try:
            async with asyncio.TaskGroup() as slices:
                while position < len(indices):
                    await window.lease(indices[position])
                    count = 1
                    while position + count < len(indices) and window.has_room():
                        await window.lease(indices[position + count])  # room: returns at once
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
        while remaining:
            abort_on = self._policy.update_begun() if run.request.config.abort_partial_rollouts else None
            kept_now, remaining = await self._generate_round(run, remaining, abort_on, resampled)
            kept += kept_now
            if remaining:
                await run.events.put(GroupsResampled(len(remaining)))
                logger.info("%s: update began; %d unfinished groups aborted, resampled after it",
                            run.request.request_id, len(remaining))
                await self._policy.wait_idle(run.deadline)
        return kept

    async def _generate_round(
        self, run: ProducerRun, indices: Sequence[int], abort_on: asyncio.Event | None, resampled: bool
    ) -> tuple[int, list[int]]:
        """Generate ``indices``' prompts and score each group as it completes.

        Returns (groups kept, prompt indices left unfinished because ``abort_on`` fired first). Groups already
        complete are scored and delivered even when generation failed or was aborted.
        """
        if run.request.config.episodes is not None and self._episodes is not None:
            round_: _Round | _EpisodeRound = _EpisodeRound(
                run, indices, self._episodes, lambda group, scores: self._hand_on(run, group, scores, resampled),
                resampled,
            )
        else:
            round_ = _Round(run, indices, self._generator, lambda group: self._score_group(run, group, resampled))
        generating = asyncio.create_task(round_.consume())
        aborted = False
        try:
            aborted = await _until_done_or_aborted(generating, abort_on)
        except asyncio.CancelledError:
            generating.cancel()
            round_.cancel_scoring()
            raise
        finally:
            results = await round_.scored()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        unfinished = [i for i in indices if i not in round_.complete] if aborted else []
        return sum(results), unfinished

    async def _score_group(self, run: ProducerRun, completions: tuple[CompletionRecord, ...], resampled: bool) -> bool:
        """Score one group and hand it to the consumer, or drop it (dynamic sampling); True when kept."""
        request = run.request
        prompt_index = completions[0].prompt_index
        spec = request.prompts[prompt_index]
        try:
            with metrics.stage_timer("score"):
                n = len(completions)
                batch = ScoreBatch(
                    queries=tuple(spec.text + c.text for c in completions), prompts=(spec.text,) * n,
                    labels=(spec.label,) * n, references=(spec.reference,) * n,
                    media=(spec.media,) * n if spec.media is not None else (),
                )
                scores = await self._scorer.score(batch, run.deadline)
        except RewardFailed as error:
            raise RewardFailed(f"prompt {prompt_index}: {error}") from error
        return await self._hand_on(run, completions, scores, resampled)

    async def _hand_on(
        self, run: ProducerRun, completions: tuple[CompletionRecord, ...], scores: Scores, resampled: bool
    ) -> bool:
        """Hand a scored group to the consumer, or drop it (dynamic sampling); True when kept."""
        request, prompt_index = run.request, completions[0].prompt_index
        config = request.config
        if config.dynamic_sampling and bool(zero_variance_groups(scores.rewards, config.n_samples_per_prompt)[0]):
            await run.events.put(Dropped(prompt_index, resampled))
            run.window.end((prompt_index,))  # never streamed: its lease admits the next prompt now
            logger.debug("%s: dropped prompt %d (all rewards equal)", request.request_id, prompt_index)
            return False
        await run.events.put(ScoredGroup(completions, scores, resampled))
        return True


class _Round:
    """One generation request's bookkeeping: samples grouped by prompt, each complete group's scoring task."""

    def __init__(
        self,
        run: ProducerRun,
        indices: Sequence[int],
        generator: Generator,
        score_group: Callable[[tuple[CompletionRecord, ...]], Awaitable[bool]],
    ) -> None:
        self._run, self._indices, self._generator, self._score_group = run, indices, generator, score_group
        self.complete: set[int] = set()
        self._scoring: set[asyncio.Task[bool]] = set()

    async def consume(self) -> None:
        """Read the generator's stream; start scoring each group as its last sample arrives."""
        request, n = self._run.request, self._run.request.config.n_samples_per_prompt
        generation = GenerationRequest(
            request_id=f"{request.request_id}-r{next(self._run.round_ids)}",
            prompts=tuple(request.prompts[i].token_ids for i in self._indices),
            sampling=request.sampling,
            n_samples_per_prompt=n,
            media=tuple(request.prompts[i].media for i in self._indices),
        )
        pending: dict[int, list[CompletionRecord]] = {}
        started = time.perf_counter()
        async with contextlib.aclosing(self._generator.generate(generation, self._run.deadline)) as records:
            async for record in records:
                if isinstance(record, Rerouted):  # a replica failed: its groups come whole from another
                    self._run.events.put_nowait(GroupsRerouted(record.groups))
                    continue
                if isinstance(record, SamplePreview):  # its forwards may run before its group is whole
                    original = self._indices[record.completion.prompt_index]
                    self._run.events.put_nowait(
                        SampleFinished(dataclasses.replace(record.completion, prompt_index=original)))
                    continue
                record = dataclasses.replace(record, prompt_index=self._indices[record.prompt_index])
                group = pending.setdefault(record.prompt_index, [])
                group.append(record)
                if len(group) == n:
                    metrics.STAGE_SECONDS.labels("generate").observe(time.perf_counter() - started)
                    del pending[record.prompt_index]
                    self.complete.add(record.prompt_index)
                    completions = tuple(sorted(group, key=lambda c: c.sample_index))
                    self._scoring.add(asyncio.create_task(self._score_group(completions)))
                for task in [t for t in self._scoring if t.done()]:
                    task.result()  # a scoring failure stops the round

    def cancel_scoring(self) -> None:
        for task in self._scoring:
            task.cancel()

    async def scored(self) -> list[bool | BaseException]:
        """Each started scoring task's result (kept or not) or error, once all are done."""
        return await asyncio.gather(*self._scoring, return_exceptions=True)


class _EpisodeRound:
    """A round of multi-turn groups: each group's n episodes run (:class:`EpisodeRunner`), and the group is handed
    on as soon as they are done, independently of the other groups. A group whose episode failed in its
    environment is reported (:class:`GroupFailed`) and the round goes on."""

    def __init__(
        self,
        run: ProducerRun,
        indices: Sequence[int],
        runner: EpisodeRunner,
        hand_on: Callable[[tuple[CompletionRecord, ...], Scores], Awaitable[bool]],
        resampled: bool = False,
    ) -> None:
        self._run, self._indices, self._runner, self._hand_on = run, indices, runner, hand_on
        self._resampled = resampled  # a failed group is then one the consumer awaits: say so
        self.complete: set[int] = set()
        self._groups: list[asyncio.Task[bool]] = []

    async def consume(self) -> None:
        """Run every group's episodes; returns when all are done (their outcomes: :meth:`scored`)."""
        self._groups = [asyncio.create_task(self._group(index)) for index in self._indices]
        await asyncio.wait(self._groups)

    async def _group(self, prompt_index: int) -> bool:
        started = time.perf_counter()
        try:
            completions, scores = await self._runner.run_group(self._run.request, prompt_index, self._run.deadline)
        except EpisodeFailed as error:
            self.complete.add(prompt_index)
            await self._run.events.put(GroupFailed(prompt_index, str(error), resampled=self._resampled))
            self._run.window.end((prompt_index,))  # never streamed: its lease admits the next prompt now
            return False
        metrics.STAGE_SECONDS.labels("episodes").observe(time.perf_counter() - started)
        self.complete.add(prompt_index)
        return await self._hand_on(completions, scores)

    def cancel_scoring(self) -> None:
        for task in self._groups:
            task.cancel()

    async def scored(self) -> list[bool | BaseException]:
        """Each group's outcome (kept or not) or error, once all are done."""
        return await asyncio.gather(*self._groups, return_exceptions=True)


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

"""The experience pipeline: generate -> score each group -> forward ready groups -> batch -> estimate -> stream.

Stages are plain functions and small Protocols; gRPC lives only in :mod:`services.experience.clients` and the
servicer. Background tasks run the generation rounds: every prompt group is scored as soon as its n samples
finish (while the engine keeps generating), and dynamic sampling drops zero-variance groups and starts a refill
round for the shortfall. The consumer runs the actor/reference/critic forwards on whatever scored groups are
ready (in a worker thread, rows sorted by length), assembles ExperienceBatches from forwarded groups, and runs
the experience math in the event loop, so the first batch streams long before the last sample is generated.

Backpressure: at most ``max_groups_ahead`` groups are generated or generating and not yet streamed; the next
prompts are sent to the generator only as batches are delivered, so a slow trainer slows generation instead of
growing memory. Cancelling the stream cancels every task, which closes the generator streams (the generator
aborts their engine requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastexp.v1 import media_pb2
from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import FastexpError, InvalidRequest, RewardFailed, StreamFailed
from services.common.weights import ReceivedUpdate, check_update, copy_into, module_spec
from services.experience.batching import concat_forward, split_experience, split_forward
from services.experience.estimate import estimate_experience
from services.experience.forward import chunks
from services.experience.logprobs import LogProbModel
from services.experience.packing import pack_experience
from services.experience.policy import PolicyState
from services.experience.processing import zero_variance_groups
from services.experience.request import ExperienceConfig, ExperienceRequest
from services.experience.runs import KLController, RunningMoments, RunState, RunStore
from services.experience.sequences import build_rollout
from services.experience.types import Experience, ForwardOutputs, Rollout
from services.experience.value_model import ValueModel
from services.generator.engine import CompletionRecord, GenerationRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scores:
    """``rewards`` (N,) float32 and named (N,) float32 metrics."""

    rewards: torch.Tensor
    metrics: dict[str, torch.Tensor]


class Generator(Protocol):
    """Where completions come from (the generator service, through :class:`GeneratorClient`)."""

    def generate(self, request: GenerationRequest, deadline: Deadline) -> AsyncIterator[CompletionRecord]: ...

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline) -> int:
        """Apply a policy update; return the new policy version once it is live."""
        ...


class Scorer(Protocol):
    """Where rewards come from (the scorer service, through :class:`ScorerClient`)."""

    async def score(
        self,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[str],
        references: Sequence[str],
        deadline: Deadline,
        media: Sequence[media_pb2.PromptMedia | None] = (),
    ) -> Scores: ...


@dataclass(frozen=True)
class ForwardModels:
    """The models the experience service runs itself; ``critic`` only when configured (``gae`` needs it)."""

    actor: LogProbModel
    reference: LogProbModel
    critic: ValueModel | None = None
    micro_batch_size: int = 8
    share_prompt: bool = True  # packed forwards compute each group's prompt once (forward.shared_prompt_chunks)


@dataclass
class StreamStats:
    """Counters of one ``make_experiences`` call, complete once the stream ends (trailing metadata)."""

    generation_rounds: int = 0
    dropped_groups: int = 0
    resampled_groups: int = 0
    undelivered_prompt_indices: list[int] | None = None  # set when the stream failed: what a retry should send


@dataclass(frozen=True)
class _ScoredGroup:
    completions: tuple[CompletionRecord, ...]  # n, in sample order
    scores: Scores
    resampled: bool = False  # came back from a resample the consumer asked for

    @property
    def prompt_index(self) -> int:
        return self.completions[0].prompt_index

    @property
    def policy_version(self) -> int:
        """The oldest version among the group's samples."""
        return min(c.policy_version for c in self.completions)


@dataclass(frozen=True)
class _ForwardedGroup:
    """A scored group with its forward outputs, (n, a) with a = the group's longest response."""

    scored: _ScoredGroup
    forward: ForwardOutputs
    actor_version: int  # the actor replica's version when it computed action_log_probs


@dataclass(frozen=True)
class _Dropped:
    prompt_index: int
    resampled: bool = False


@dataclass(frozen=True)
class _Done:
    pass


_Item = _ScoredGroup | _Dropped | _Done | BaseException


@dataclass
class _Stream:
    """One ``make_experiences`` call's shared state: where scored groups go and what asks for resampling."""

    request: ExperienceRequest
    deadline: Deadline
    stats: StreamStats
    start_version: int  # v0: the policy version when the request started
    window: asyncio.Semaphore | None = None  # one slot per group generated and not yet streamed (backpressure)
    ready: asyncio.Queue[_Item] = field(default_factory=asyncio.Queue)
    resample: asyncio.Queue[int] = field(default_factory=asyncio.Queue)  # prompt indices to generate again
    round_ids: itertools.count = field(default_factory=itertools.count)

    def release(self, groups: int) -> None:
        """``groups`` groups were streamed or dropped: their slots admit the next prompts."""
        if self.window is not None:
            for _ in range(groups):
                self.window.release()


@dataclass(eq=False)
class _Inbox:
    """What the consumer has received: scored groups waiting for a forward pass, forwarded groups waiting for a
    batch, dynamic-sampling drops, and whether more can come."""

    pending: list[_ScoredGroup] = field(default_factory=list)
    forwarded: list[_ForwardedGroup] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    awaiting: int = 0  # groups sent back for resampling, not yet returned
    producer_done: bool = False
    failure: BaseException | None = None  # raised once the groups received before it are delivered

    @property
    def finished(self) -> bool:
        """Nothing more will arrive."""
        return self.failure is not None or (self.producer_done and self.awaiting == 0)

    def take(self, item: _Item, stream: _Stream) -> None:
        if isinstance(item, BaseException):
            self.failure = self.failure or item
        elif isinstance(item, _Done):
            self.producer_done = True
        else:
            self.awaiting -= item.resampled
            if isinstance(item, _Dropped):
                self.dropped.append(item.prompt_index)
                stream.stats.dropped_groups += 1
                stream.release(1)
            else:
                self.pending.append(item)

    def batch_ready(self, config: ExperienceConfig) -> bool:
        """A batch can be assembled: enough forwarded groups, or the last ones (all of them for rollout scope)."""
        last = self.finished and not self.pending and bool(self.forwarded)
        return last or (not config.rollout_scope and len(self.forwarded) >= config.groups_per_batch)


_LIVE_INBOXES: weakref.WeakSet[_Inbox] = weakref.WeakSet()  # the streams being served, for the queue gauges
metrics.QUEUE_DEPTH.labels("scored").set_function(lambda: sum(len(i.pending) for i in _LIVE_INBOXES))
metrics.QUEUE_DEPTH.labels("forwarded").set_function(lambda: sum(len(i.forwarded) for i in _LIVE_INBOXES))


class ExperienceMaker:
    """Makes experiences; calls may run concurrently (forward passes are serialized, they share the device).

    Also applies weight updates to the models it runs (:meth:`update_weights`), in step with the generator.
    """

    def __init__(
        self,
        generator: Generator,
        scorer: Scorer,
        models: ForwardModels,
        pad_token_id: int,
        runs: RunStore | None = None,
        policy: PolicyState | None = None,
        max_groups_ahead: int = 64,
    ) -> None:
        """``max_groups_ahead``: the most prompt groups of one stream generated or generating and not yet streamed
        (raised to a batch's groups; the whole request with ``normalization_scope = rollout``)."""
        self._generator = generator
        self._scorer = scorer
        self._models = models
        self._pad_token_id = pad_token_id
        self._runs = runs if runs is not None else RunStore()
        self._forward_lock = asyncio.Lock()
        self.policy = policy if policy is not None else PolicyState()
        self._actor_version = self.policy.version  # changed under the forward lock, with the actor's weights
        metrics.POLICY_VERSION.set_function(lambda: self.policy.version)
        self.critic_version = 0
        self._max_groups_ahead = max_groups_ahead

    def adopt_policy_version(self, version: int) -> None:
        """At start-up, before any stream or update: the generator serves ``version``; the actor replica is
        counted at it too (the service warns when that is not 0: the replica holds the weights it loaded)."""
        self.policy.version = version
        self._actor_version = version

    @property
    def has_critic(self) -> bool:
        """Whether a value model runs here (requests for ``gae`` are validated against it)."""
        return self._models.critic is not None

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        """Apply a checked weight update to the policy (generator, then actor replica) or the critic.

        A policy update is checked against the actor replica, forwarded to the generator (live there when it
        answers), then copied into the actor between forward passes; ``self.policy.version`` becomes the
        generator's new version. While it runs, aborting partial rollouts stop (``PolicyState.update_begun``).

        Raises:
            InvalidRequest: a tensor the model does not have (named), a wrong shape, no critic; the generator's
                rejection. Nothing was applied anywhere.
            NotReady, UpstreamTimeout, Overloaded: the generator did not apply it; nothing changed here.
        """
        if update.target == "critic":
            critic = self._models.critic
            if critic is None:
                raise InvalidRequest("header.target", "this experience service runs no critic (set critic_model)")
            tensors = critic.tensors()
            check_update(update.entries, module_spec(tensors))
            async with self._forward_lock:
                await asyncio.shield(asyncio.to_thread(copy_into, tensors, update.entries))
                self.critic_version += 1
            return
        tensors = self._models.actor.tensors()
        check_update(update.entries, module_spec(tensors))
        await self.policy.begin_update()
        version = None
        try:
            version = await self._generator.update_weights(update, deadline)
            # the generator serves it now: the replica must follow even if the caller goes away
            await asyncio.shield(self._update_actor(tensors, update, version))
        finally:
            await self.policy.end_update(version)
        logger.info("policy version %d live (%d tensors, %d bytes)", version, len(update.entries), update.num_bytes)

    async def _update_actor(self, tensors: dict[str, torch.Tensor], update: ReceivedUpdate, version: int) -> None:
        async with self._forward_lock:
            await asyncio.to_thread(copy_into, tensors, update.entries)
            self._actor_version = version

    async def make_experiences(
        self, request: ExperienceRequest, deadline: Deadline, stats: StreamStats | None = None
    ) -> AsyncIterator[Experience]:
        """Yield Experiences of whole prompt groups, each delivered group exactly once, as groups finish.

        Groups scored before a generation failure are still delivered, then the failure is raised as
        :class:`StreamFailed` listing the prompt indices neither delivered nor reported dropped. ``stats``
        (optional) is filled in as the stream runs: generation rounds, dynamic-sampling drops, resamples, and on
        failure the undelivered prompt indices.

        With ``max_staleness`` s, batch b waits for policy version v0 + b - s and holds only groups sampled at that
        version or later; older groups go back for resampling (see ``MakeExperiencesRequest.max_staleness``).
        With ``normalization_scope = rollout`` the whole request is estimated at once, then streamed in batches.

        Raises:
            StreamFailed: with the status code of its cause: NotReady, UpstreamTimeout or InvalidRequest from the
                generator or scorer clients (UpstreamTimeout also when the deadline passes while waiting for the
                trainer's policy update); RewardFailed when a reward source could not score a group (the
                message names the prompt and source).
        """
        config = request.config
        window = None if config.rollout_scope else max(self._max_groups_ahead, config.groups_per_batch)
        stream = _Stream(
            request, deadline, stats if stats is not None else StreamStats(), self.policy.version,
            window=None if window is None else asyncio.Semaphore(window),
        )
        producer = asyncio.create_task(self._produce(stream), name=request.request_id)
        resampler = asyncio.create_task(self._resample(stream), name=f"{request.request_id}-resample")
        inbox = _Inbox()
        _LIVE_INBOXES.add(inbox)
        metrics.ACTIVE_STREAMS.inc()
        local_state = _initial_state(config)
        handled: set[int] = set()  # prompt indices delivered to the trainer or reported dropped
        try:
            batch_index, resampled_reported = 0, 0
            while True:
                while not stream.ready.empty():
                    inbox.take(stream.ready.get_nowait(), stream)
                if inbox.batch_ready(config):  # deliver before forwarding more: the trainer is waiting
                    groups = await self._take_batch(stream, inbox, batch_index)
                    if not groups:
                        continue
                    state = self._runs.get(config.run_id, _initial_state(config)) if config.run_id else local_state
                    with metrics.stage_timer("advantages"):
                        experience, state = estimate_experience(
                            *self._assemble(groups, request), config, state, batch_index, tuple(inbox.dropped)
                        )
                    _observe_distributions(experience)
                    if config.run_id:
                        self._runs.put(config.run_id, state)
                    else:
                        local_state = state
                    handled.update(inbox.dropped)
                    inbox.dropped.clear()
                    experience = experience._replace(
                        actor_policy_version=min(g.actor_version for g in groups),
                        resampled_groups=stream.stats.resampled_groups - resampled_reported,
                    )
                    resampled_reported = stream.stats.resampled_groups
                    parts = split_experience(experience, config.groups_per_batch * config.n_samples_per_prompt)
                    for part in parts:
                        with metrics.stage_timer("stream"):  # how long the trainer takes to take it
                            yield pack_experience(part) if config.return_packed else part
                        metrics.EXPERIENCE_SAMPLES.inc(len(part.reward))
                        handled.update(part.prompt_index)
                        stream.release(len(part.reward) // config.n_samples_per_prompt)
                    batch_index += len(parts)
                elif inbox.pending:
                    inbox.forwarded.extend(await self._forward_ready(inbox, request))
                elif inbox.finished:
                    break
                else:
                    inbox.take(await stream.ready.get(), stream)
            if inbox.failure is not None:
                raise inbox.failure
        except FastexpError as error:  # a failed stream says which prompts to send again
            undelivered = [i for i in range(len(request.prompts)) if i not in handled]
            stream.stats.undelivered_prompt_indices = undelivered
            raise StreamFailed(error, undelivered) from error
        finally:
            metrics.ACTIVE_STREAMS.dec()
            _LIVE_INBOXES.discard(inbox)
            for task in (producer, resampler):
                task.cancel()
            await asyncio.gather(producer, resampler, return_exceptions=True)

    async def _take_batch(self, stream: _Stream, inbox: _Inbox, batch_index: int) -> list[_ForwardedGroup]:
        """The next batch's groups (all of them with rollout scope); [] when stale groups went back for resampling.

        With ``max_staleness`` s, waits for policy version v0 + b - s first (the trainer's update) and sends every
        forwarded group sampled before it back to the generator (dropped instead after a failure).
        """
        config = stream.request.config
        if config.max_staleness is not None:
            oldest = stream.start_version + batch_index - config.max_staleness
            await self.policy.wait_for_version(oldest, stream.deadline)
            stale = [g for g in inbox.forwarded if g.scored.policy_version < oldest]
            if stale:
                inbox.forwarded = [g for g in inbox.forwarded if g.scored.policy_version >= oldest]
                if inbox.failure is not None:  # cannot be resampled any more; never streamed
                    logger.warning("%s: %d stale groups not delivered after a failure",
                                   stream.request.request_id, len(stale))
                    stream.release(len(stale))
                    return []
                for group in stale:
                    stream.resample.put_nowait(group.scored.prompt_index)
                inbox.awaiting += len(stale)
                stream.stats.resampled_groups += len(stale)
                logger.info("%s: batch %d: %d groups older than version %d resampled",
                            stream.request.request_id, batch_index, len(stale), oldest)
                return []
        size = len(inbox.forwarded) if config.rollout_scope else config.groups_per_batch
        groups, inbox.forwarded = inbox.forwarded[:size], inbox.forwarded[size:]
        return groups

    # ------------------------------------------------------------------------------------------------------------
    # Producer: generation rounds, per-group scoring, dynamic sampling, off-policy admission, resampling
    # ------------------------------------------------------------------------------------------------------------

    async def _produce(self, stream: _Stream) -> None:
        """Generate every group once (then ``_Done``); errors go to the consumer, which raises them in order."""
        try:
            if stream.request.config.max_staleness is None:
                await self._produce_rounds(stream)
            else:
                await self._produce_admitted(stream)
            await stream.ready.put(_Done())
        except Exception as error:  # handed to the consumer, which delivers what is ready, then raises it
            await stream.ready.put(error)

    async def _produce_rounds(self, stream: _Stream) -> None:
        """Run generation rounds until enough groups are kept (all prompts without dynamic sampling)."""
        request, stats = stream.request, stream.stats
        dynamic = request.config.dynamic_sampling
        target = dynamic.num_groups if dynamic else len(request.prompts)
        rounds_left = 1 + (dynamic.max_extra_rounds if dynamic else 0)
        next_prompt, kept = 0, 0
        while kept < target and rounds_left > 0 and next_prompt < len(request.prompts):
            indices = range(next_prompt, min(len(request.prompts), next_prompt + target - kept))
            next_prompt = indices.stop
            rounds_left -= 1
            stats.generation_rounds += 1
            kept += await self._run_round(stream, indices)

    async def _produce_admitted(self, stream: _Stream) -> None:
        """Off-policy admission: batch b's prompts start generating once the policy reaches v0 + b - s, so at
        most s + 1 batches run ahead of the trainer (AReaL's staleness control, arXiv 2505.24298)."""
        config, prompts = stream.request.config, stream.request.prompts
        per_batch, staleness = config.groups_per_batch, config.max_staleness or 0
        try:
            async with asyncio.TaskGroup() as rounds:
                for batch, start in enumerate(range(0, len(prompts), per_batch)):
                    await self.policy.wait_for_version(stream.start_version + batch - staleness, stream.deadline)
                    stream.stats.generation_rounds += 1
                    rounds.create_task(self._run_round(stream, range(start, min(len(prompts), start + per_batch))))
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None

    async def _resample(self, stream: _Stream) -> None:
        """Generate again the groups the consumer found too stale, as they come (runs for the whole stream)."""
        try:
            while True:
                indices = [await stream.resample.get()]
                while not stream.resample.empty():
                    indices.append(stream.resample.get_nowait())
                await self._run_round(stream, indices, resampled=True)
        except Exception as error:
            await stream.ready.put(error)

    async def _run_round(self, stream: _Stream, indices: Sequence[int], resampled: bool = False) -> int:
        """Generate and score ``indices``' groups; returns how many were kept.

        Each prompt takes a window slot first (backpressure): the prompts whose slots are free now go to the
        generator together, the rest as slots free up. Resampled groups reuse the slot they already hold.
        """
        if resampled or stream.window is None:
            return await self._run_slice(stream, indices, resampled)
        window, tasks, position = stream.window, [], 0
        try:
            async with asyncio.TaskGroup() as slices:
                while position < len(indices):
                    await window.acquire()
                    count = 1
                    while position + count < len(indices) and not window.locked():
                        await window.acquire()  # a free slot: returns at once
                        count += 1
                    part = indices[position : position + count]
                    tasks.append(slices.create_task(self._run_slice(stream, part, resampled)))
                    position += count
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return sum(task.result() for task in tasks)

    async def _run_slice(self, stream: _Stream, indices: Sequence[int], resampled: bool) -> int:
        """Generate and score ``indices``' groups; with aborting partial rollouts, groups an update interrupts
        are generated again under the new weights. Returns how many groups were kept."""
        remaining, kept = list(indices), 0
        while remaining:
            abort_on = self.policy.update_begun() if stream.request.config.abort_partial_rollouts else None
            kept_now, remaining = await self._generate_round(stream, remaining, abort_on, resampled)
            kept += kept_now
            if remaining:
                stream.stats.resampled_groups += len(remaining)
                logger.info("%s: update began; %d unfinished groups aborted, resampled after it",
                            stream.request.request_id, len(remaining))
                await self.policy.wait_idle(stream.deadline)
        return kept

    async def _generate_round(
        self, stream: _Stream, indices: Sequence[int], abort_on: asyncio.Event | None, resampled: bool
    ) -> tuple[int, list[int]]:
        """Generate ``indices`` prompts and score each group as it completes.

        Returns (groups kept, prompt indices left unfinished because ``abort_on`` fired first).
        """
        request = stream.request
        n = request.config.n_samples_per_prompt
        generation = GenerationRequest(
            request_id=f"{request.request_id}-r{next(stream.round_ids)}",
            prompts=tuple(request.prompts[i].token_ids for i in indices),
            sampling=request.sampling,
            n_samples_per_prompt=n,
            media=tuple(request.prompts[i].media for i in indices),
        )
        pending: dict[int, list[CompletionRecord]] = {}
        complete: set[int] = set()
        scoring: set[asyncio.Task[bool]] = set()

        started = time.perf_counter()

        async def consume() -> None:
            async with contextlib.aclosing(self._generator.generate(generation, stream.deadline)) as records:
                async for record in records:
                    record = dataclasses.replace(record, prompt_index=indices[record.prompt_index])
                    group = pending.setdefault(record.prompt_index, [])
                    group.append(record)
                    if len(group) == n:
                        metrics.STAGE_SECONDS.labels("generate").observe(time.perf_counter() - started)
                        del pending[record.prompt_index]
                        complete.add(record.prompt_index)
                        completions = tuple(sorted(group, key=lambda c: c.sample_index))
                        scoring.add(asyncio.create_task(self._score_group(stream, completions, resampled)))
                    for task in [t for t in scoring if t.done()]:
                        task.result()  # a scoring failure stops the round

        generating = asyncio.create_task(consume())
        aborted = False
        try:
            if abort_on is None:
                await generating
            else:
                watcher = asyncio.create_task(abort_on.wait())
                try:
                    await asyncio.wait({generating, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watcher.cancel()
                aborted = not generating.done()
                if aborted:  # closing the stream aborts the generator's unfinished samples
                    generating.cancel()
                    await asyncio.gather(generating, return_exceptions=True)
                else:
                    generating.result()
        except asyncio.CancelledError:
            generating.cancel()
            for task in scoring:
                task.cancel()
            raise
        finally:
            # groups already complete are scored and delivered even when generation failed or was aborted
            results = await asyncio.gather(*scoring, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        unfinished = [i for i in indices if i not in complete] if aborted else []
        return sum(results), unfinished

    async def _score_group(self, stream: _Stream, completions: tuple[CompletionRecord, ...], resampled: bool) -> bool:
        """Score one group and hand it to the consumer, or drop it (dynamic sampling); True when kept."""
        request = stream.request
        prompt_index = completions[0].prompt_index
        spec = request.prompts[prompt_index]
        try:
            with metrics.stage_timer("score"):
                scores = await self._scorer.score(
                    queries=[spec.text + c.text for c in completions],
                    prompts=[spec.text] * len(completions),
                    labels=[spec.label] * len(completions),
                    references=[spec.reference] * len(completions),
                    deadline=stream.deadline,
                    media=[spec.media] * len(completions) if spec.media is not None else (),
                )
        except RewardFailed as error:
            raise RewardFailed(f"prompt {prompt_index}: {error}") from error
        config = request.config
        if config.dynamic_sampling and bool(zero_variance_groups(scores.rewards, config.n_samples_per_prompt)[0]):
            await stream.ready.put(_Dropped(prompt_index, resampled))
            logger.debug("%s: dropped prompt %d (all rewards equal)", request.request_id, prompt_index)
            return False
        await stream.ready.put(_ScoredGroup(completions, scores, resampled))
        return True

    # ------------------------------------------------------------------------------------------------------------
    # Consumer: forwards
    # ------------------------------------------------------------------------------------------------------------

    async def _forward_ready(self, inbox: _Inbox, request: ExperienceRequest) -> list[_ForwardedGroup]:
        """Run the forward passes on the scored groups that are ready, oldest first, up to a batch's rows (at
        least the models' micro-batch and one group); they leave ``inbox.pending``."""
        config, n = request.config, request.config.n_samples_per_prompt
        budget = max(config.micro_rollout_batch_size, self._models.micro_batch_size, n)
        count = max(1, min(len(inbox.pending), budget // n))
        groups, inbox.pending = inbox.pending[:count], inbox.pending[count:]
        async with self._forward_lock:
            forwards = await asyncio.to_thread(self._forward_groups, groups, request)
            actor_version = self._actor_version
        return [_ForwardedGroup(g, f, actor_version) for g, f in zip(groups, forwards, strict=True)]

    def _forward_groups(self, groups: list[_ScoredGroup], request: ExperienceRequest) -> list[ForwardOutputs]:
        """Per-group forward outputs (n, a_g) of ``groups`` (runs in a worker thread).

        Padded forwards sort the rows by length first, so each micro-batch pads only to rows of similar length.
        """
        completions = [c for g in groups for c in g.completions]
        order = list(range(len(completions)))
        if not request.config.packing_samples:
            order.sort(key=lambda i: len(completions[i].prompt_token_ids) + len(completions[i].output_token_ids))
        rollout = build_rollout(
            [completions[i] for i in order], request.prompts, self._pad_token_id, self._models.actor.vision_tokens
        )
        forward = self._forward(rollout, request.config)
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        forward = ForwardOutputs(*(None if t is None else t[inverse] for t in forward))
        widths = [max(1, max(len(c.output_token_ids) for c in g.completions)) for g in groups]
        return split_forward(forward, [len(g.completions) for g in groups], widths)

    def _forward(self, rollout: Rollout, config: ExperienceConfig) -> ForwardOutputs:
        """Actor, reference (and critic) passes over the rollout's rows (runs in a worker thread)."""
        models = self._models
        # a vision-language model's rows stay padded: its M-RoPE positions are not the packed layouts' 1D ones
        packed = config.packing_samples and models.actor.vision_tokens is None
        parts = chunks(rollout, models.micro_batch_size, packed=packed, share_prompt=models.share_prompt)
        with metrics.stage_timer("actor"):
            actor, entropy = models.actor.action_log_probs(parts, with_entropy=config.return_action_entropy)
        with metrics.stage_timer("reference"):
            reference, _ = models.reference.action_log_probs(parts)
        values = None
        if config.estimator.needs_critic:
            if models.critic is None:
                raise ValueError("gae needs a critic")  # request validation rejects this first
            with metrics.stage_timer("critic"):
                values = models.critic.values(parts)
        return ForwardOutputs(actor, reference, values, entropy)

    def _assemble(
        self, groups: list[_ForwardedGroup], request: ExperienceRequest
    ) -> tuple[Rollout, torch.Tensor, dict[str, torch.Tensor], ForwardOutputs]:
        """A batch's rollout, rewards (B,), reward metrics (B,) each (NaN for rows whose scorer lacks one) and
        forward outputs (B, A), from its forwarded groups in order."""
        rollout = build_rollout(
            [c for g in groups for c in g.scored.completions], request.prompts, self._pad_token_id,
            self._models.actor.vision_tokens,
        )
        if rollout.repaired_vision_tokens:
            metrics.VISION_TOKEN_REPAIRS.labels("response_placeholder").inc(rollout.repaired_vision_tokens)
            logger.debug("%s: %d sampled placeholder tokens replaced by the pad token",
                         request.request_id, rollout.repaired_vision_tokens)
        if rollout.vision_prompt_mismatches:
            metrics.VISION_TOKEN_REPAIRS.labels("prompt_mismatch").inc(rollout.vision_prompt_mismatches)
        forward = concat_forward([g.forward for g in groups], rollout.action_mask.shape[1])
        scores = [g.scored.scores for g in groups]
        rewards = torch.cat([s.rewards.float() for s in scores])
        names = sorted({name for s in scores for name in s.metrics})
        reward_metrics = {
            name: torch.cat([
                s.metrics[name].float() if name in s.metrics else torch.full((len(s.rewards),), float("nan"))
                for s in scores
            ])
            for name in names
        }
        return rollout, rewards, reward_metrics, forward


def _observe_distributions(experience: Experience) -> None:
    """Each row's reward and mean per-token KL (nats, over ``action_mask``) into their histograms."""
    mask = experience.action_mask.float()
    kl = (experience.kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    for reward, row_kl in zip(experience.reward.tolist(), kl.tolist(), strict=True):
        if math.isfinite(reward):  # a NaN would poison the histogram's sum for good
            metrics.REWARD.observe(reward)
        if math.isfinite(row_kl):
            metrics.KL_NATS.observe(row_kl)


def _initial_state(config: ExperienceConfig) -> RunState:
    kl = config.kl
    return RunState(RunningMoments(), KLController(kl.kl_coef, kl.kl_target, kl.kl_horizon))

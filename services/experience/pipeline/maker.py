"""The experience pipeline: generate -> score each group -> forward ready groups -> batch -> estimate -> stream.

:class:`ExperienceMaker` only wires the stages; each lives in its own module and passes immutable records:

- **producer** (:mod:`~services.experience.pipeline.producer`): generation rounds, off-policy admission, resampling, and
  scoring of each group as its samples finish → events (:mod:`~services.experience.pipeline.events`) on a queue.
- **forwarder** (:mod:`~services.experience.pipeline.forwarder`): actor/reference/critic forwards in a thread; batches.
- **batcher** (:mod:`~services.experience.pipeline.batcher`): pure functions over the consumer's inbox: what to do next,
  which groups make the next batch, which are too stale.
- **weight sync** (:mod:`~services.experience.pipeline.weight_sync`): policy and critic updates, the live version.
- **estimate** (:mod:`~fastexp.rl.estimate`): KL, reward shaping, returns and advantages (pure).

The consumer of one stream (:class:`_Consumer`) folds events into its inbox, forwards what is ready, and streams
batches as soon as they are complete, so the first batch streams long before the last sample is generated.
Backpressure: at most ``max_groups_ahead`` groups are generated or generating and not yet streamed; a slow
trainer slows generation instead of growing memory. Cancelling the stream cancels the producer's tasks, which
closes the generator streams (the generator aborts their engine requests).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastexp.packing import pack_experience
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.running import RunState
from fastexp.types import Experience
from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import FastexpError, InvalidRequest, StreamFailed
from services.common.lora import AdapterConfig
from services.common.versions import Snapshot
from services.common.weights import ReceivedUpdate, TensorSpec
from services.experience.config import ExperienceConfig, ExperienceRequest
from services.experience.pipeline import batcher
from services.experience.pipeline import statistics as run_statistics
from services.experience.pipeline.assembly import split_experience
from services.experience.pipeline.batcher import Inbox, Step
from services.experience.pipeline.episodes import EpisodeRunner
from services.experience.pipeline.events import (
    Agents,
    Dropped,
    Event,
    ForwardedGroup,
    Generator,
    GroupFailed,
    GroupsRerouted,
    GroupsResampled,
    RoundStarted,
    SampleFinished,
    Scorer,
    Scores,
    StreamStats,
)
from services.experience.pipeline.fair_share import FairShare
from services.experience.pipeline.forwarder import EarlyForwards, ForwardCores, Forwarder, ForwardModels
from services.experience.pipeline.ledger import VersionLedger
from services.experience.pipeline.producer import Producer, ProducerRun
from services.experience.pipeline.rollouts import RolloutParts
from services.experience.pipeline.streams import counted_groups
from services.experience.pipeline.versions import PolicyClocks, VersionClock
from services.experience.pipeline.weight_sync import WeightSync

if TYPE_CHECKING:  # annotations only: the pipeline takes any replica client
    from services.experience.fleet.replicas import ReplicaClient

__all__ = ["ExperienceMaker", "ForwardModels", "Generator", "Scorer", "Scores", "StreamStats"]

logger = logging.getLogger(__name__)


class ExperienceMaker:
    """Makes experiences; calls may run concurrently (forward passes are serialized, they share the device).

    Also applies weight updates to the models it runs (:meth:`update_weights`), in step with the generator.
    ``max_groups_ahead``: the most prompt groups of one stream generated or generating and not yet streamed
    (raised to a batch's groups; the whole request with ``normalization_scope = rollout``).
    """

    def __init__(
        self,
        generator: Generator,
        scorer: Scorer,
        models: ForwardModels,
        pad_token_id: int,
        runs: run_statistics.RunStatistics | None = None,
        policy: VersionClock | None = None,
        max_groups_ahead: int = 64,
        sync_timeout_s: float = 600.0,
        episodes: EpisodeRunner | None = None,
        cores: ForwardCores | None = None,
        agents: Agents | None = None,
        max_samples_in_flight: int | None = None,
        ledger: VersionLedger | None = None,
    ) -> None:
        self.policy = policy if policy is not None else VersionClock()
        self.clocks = PolicyClocks(self.policy)  # the base policy's, and each LoRA run's adapter's
        self._generator = generator
        self._forwarder = Forwarder(models, pad_token_id, actor_version=self.policy.version, cores=cores)
        self._share = FairShare(max_samples_in_flight)  # the generator's capacity, shared by the runs
        self._weights = WeightSync(generator, self._forwarder, self.clocks, sync_timeout_s, ledger)
        self._stages = _Stages(
            Producer(RolloutParts(generator, scorer, episodes, agents), self.clocks, max_groups_ahead, self._share),
            self._forwarder, runs if runs is not None else run_statistics.MemoryStatistics(),
        )
        self._consumers: set[_Consumer] = set()
        self.runs_episodes = episodes is not None  # multi-turn requests are accepted
        self.serves_adapters = models.adapters is not None  # LoRA runs are accepted
        self._agents = agents

    def share_usage(self, tenant: str) -> tuple[int, int]:
        """``tenant``'s (:attr:`ExperienceRequest.tenant`, e.g. a created run's ``run:<id>``) prompt groups generating now and waiting for generator capacity."""
        return self._share.groups_in_flight(tenant), self._share.queued(tenant)

    def check_agent(self, name: str) -> None:
        """Raises :class:`InvalidRequest` (``agent``/``agent.name``) unless agent episodes run here and ``name`` is
        one of the operator's agents."""
        if self._agents is None:
            raise InvalidRequest("agent", "this experience service runs no agent episodes (set gateway_port and agents)")
        self._agents.check(name)

    def adopt_policy_version(self, version: int) -> None:
        """At start-up, before any stream or update: the generator serves ``version``; the actor replica is
        counted at it too (the service warns when that is not 0: the replica holds the weights it loaded)."""
        self.policy.version = version
        self._forwarder.actor_version = version

    @property
    def has_critic(self) -> bool:
        """Whether a value model runs here (requests for ``gae`` are validated against it)."""
        return self._forwarder.has_critic

    @property
    def critic_version(self) -> int:
        """Critic updates applied since start (0, 1, ...)."""
        return self._weights.critic_version

    def queue_depth(self, queue: str) -> int:
        """Groups of the streams being served that wait for a forward pass (``scored``) or a batch
        (``forwarded``): the ``fastexp_queue_depth`` gauge."""
        field = {"scored": "pending", "forwarded": "forwarded"}[queue]
        return sum(len(getattr(consumer.inbox, field)) for consumer in self._consumers)

    def update_spec(self, target: str) -> dict[str, TensorSpec]:
        """What an update of ``target`` is checked against (:meth:`services.experience.pipeline.weight_sync.WeightSync.spec`)."""
        return self._weights.spec(target)

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        """Apply a checked weight update (see :meth:`services.experience.pipeline.weight_sync.WeightSync.update`)."""
        await self._weights.update(update, deadline)

    def adapter_spec(self, config: AdapterConfig) -> dict[str, TensorSpec]:
        """What a LoRA run's adapter update is checked against (:meth:`WeightSync.adapter_spec`)."""
        return self._weights.adapter_spec(config)

    async def update_adapter(self, name: str, config: AdapterConfig, update: ReceivedUpdate, deadline: Deadline) -> int:
        """Apply a LoRA run's adapter update; returns the run's version now live (:meth:`WeightSync.update_adapter`)."""
        return await self._weights.update_adapter(name, config, update, deadline)

    def adapter_version(self, name: str) -> int:
        """The live version of LoRA run ``name``'s adapter (0: none was sent yet)."""
        return self.clocks.live_adapters().get(name, 0)

    async def remove_adapter(self, name: str) -> None:
        """Free a deleted LoRA run's adapter here (:meth:`WeightSync.remove_adapter`), then on every generator
        replica; callers shield it from a cancelled DeleteRun (stopped half-way, the forwarder could keep it)."""
        await self._weights.remove_adapter(name)
        await self._generator.unload_adapter(name)

    async def offload_models(self) -> tuple[int, tuple[str, ...]]:
        """Move the models to host memory (:meth:`Forwarder.offload`); :meth:`reload_models` moves them back."""
        return await self._forwarder.offload()

    async def reload_models(self) -> tuple[int, tuple[str, ...]]:  # noqa: D102 - see offload_models
        return await self._forwarder.reload()

    def require_models_loaded(self, what: str) -> None:
        """Raises FailedPrecondition naming ``what`` while the models are offloaded."""
        self._forwarder.require_loaded(what)

    async def catch_up(self) -> Snapshot | None:
        """Load the live versions other experience replicas made (:meth:`WeightSync.catch_up`)."""
        return await self._weights.catch_up()

    def on_policy_live(self, follow: Callable[[int], None]) -> None:
        """Tell ``follow`` each new live policy version the ledger shows (the generator fleet's version)."""
        self._weights.on_policy_live = follow

    async def sync_replica(self, replica: ReplicaClient, version: Callable[[], int]) -> int:
        """Send a generator replica the live weights (the fleet's weight source: :meth:`WeightSync.sync_replica`)."""
        return await self._weights.sync_replica(replica, version)

    def settled_adapters(self) -> dict[str, tuple[int, str | None]]:
        """What a generator replica must hold to serve (:meth:`WeightSync.settled_adapters`)."""
        return self._weights.settled_adapters()

    async def make_experiences(
        self, request: ExperienceRequest, deadline: Deadline, stats: StreamStats | None = None,
        statistics: run_statistics.StatisticsKey | None = None,
    ) -> AsyncIterator[Experience]:
        """Yield Experiences of whole prompt groups, each delivered group exactly once, as groups finish.

        Groups scored before a generation failure are still delivered, then the failure is raised as
        :class:`StreamFailed` listing the prompt indices neither delivered nor reported dropped. ``stats``
        (optional) is filled in as the stream runs: generation rounds, dynamic-sampling drops, resamples, and on
        failure the undelivered prompt indices. ``statistics``: whose running statistics (reward moments, adaptive
        beta) the batches advance (:class:`run_statistics.StatisticsKey`; None: the stream's own, starting afresh).

        With ``max_staleness`` s, batch b waits for policy version v0 + b - s and holds only groups sampled at that
        version or later; older groups go back for resampling (see ``MakeExperiencesRequest.max_staleness``).
        With ``normalization_scope = rollout`` the whole request is estimated at once, then streamed in batches.

        Raises:
            StreamFailed: with the status code of its cause: NotReady, UpstreamTimeout or InvalidRequest from the
                generator or scorer clients (UpstreamTimeout also when the deadline passes while waiting for the
                trainer's policy update); RewardFailed when a reward source could not score a group (the
                message names the prompt and source).
        """
        consumer = _Consumer(self._stages, request, deadline, stats if stats is not None else StreamStats(),
                             statistics)
        self._consumers.add(consumer)
        metrics.ACTIVE_STREAMS.inc()
        try:
            async with contextlib.aclosing(consumer.run()) as experiences:
                async for experience in experiences:
                    yield experience
        finally:
            metrics.ACTIVE_STREAMS.dec()
            self._consumers.discard(consumer)


@dataclass(frozen=True)
class _Stages:
    """What every stream's consumer works with (shared by the streams of one service)."""

    producer: Producer
    forwarder: Forwarder
    runs: run_statistics.RunStatistics


class _Consumer:
    """One stream's consumer: receives events, forwards ready groups, estimates and streams batches."""

    def __init__(self, stages: _Stages, request: ExperienceRequest, deadline: Deadline, stats: StreamStats,
                 statistics: run_statistics.StatisticsKey | None = None):
        self._stages, self._request, self._deadline, self._stats = stages, request, deadline, stats
        run_id = request.config.run_id  # a maker used without the servicer keeps statistics under the run_id
        self._statistics = statistics or (run_statistics.StatisticsKey(run_id) if run_id else None)
        self._config: ExperienceConfig = request.config
        self.inbox = Inbox()
        self._handled: set[int] = set()  # prompt indices delivered to the trainer or reported dropped
        self._batch_index = 0 if request.stream is None else request.stream.first_batch_index
        self._resampled_reported = 0
        self._local_state = run_statistics.initial_state(self._config)
        # prompt_overflow SKIP: reported like dynamic-sampling drops, with the first batch
        self._skipped_unreported = request.skipped_prompt_indices
        stats.dropped_groups += len(request.skipped_prompt_indices)
        # samples forwarded while their groups generate, where that pays (not with dynamic sampling: groups may drop)
        self._early = EarlyForwards() if stages.forwarder.early_forwards(request.config) else None

    async def run(self) -> AsyncIterator[Experience]:
        run = self._stages.producer.start(self._request, self._deadline)
        try:
            while True:
                while not run.events.empty():
                    self._receive(run.events.get_nowait(), run)
                step = batcher.next_step(self.inbox, self._config)
                if step is Step.DELIVER:
                    groups = await self._take_batch(run)
                    for part in await self._estimate(groups) if groups else ():
                        outward = self._in_request_indices(part)
                        with metrics.stage_timer("stream"):  # how long the trainer takes to take it
                            yield pack_experience(outward) if self._config.return_packed else outward
                        self._delivered(part, run)
                elif step is Step.FORWARD:
                    await self._forward()
                elif step is Step.FORWARD_EARLY:
                    await self._forward_early()
                elif step is Step.FINISH:
                    break
                else:
                    self._receive(await run.events.get(), run)
            if self.inbox.failure is not None:
                raise self.inbox.failure
        except FastexpError as error:  # a failed stream says which prompts to send again
            request = self._request
            undelivered = [request.source_index(i) for i in range(len(request.prompts)) if i not in self._handled]
            self._stats.undelivered_prompt_indices = undelivered
            raise StreamFailed(error, undelivered) from error
        finally:
            await run.close()

    def _receive(self, event: Event, run: ProducerRun) -> None:
        if isinstance(event, SampleFinished) and self._early is None:
            return
        self.inbox = batcher.receive(self.inbox, event)
        if isinstance(event, Dropped | GroupFailed) and self._early is not None:
            self._early.discard(event.prompt_index)
        if isinstance(event, Dropped):
            self._stats.dropped_groups += 1
        elif isinstance(event, RoundStarted):
            self._stats.generation_rounds += 1
        elif isinstance(event, GroupsResampled):
            self._stats.resampled_groups += event.count
        elif isinstance(event, GroupsRerouted):
            self._stats.rerouted_groups += event.count
        elif isinstance(event, GroupFailed):
            self._stats.failed_groups.append(self._request.source_index(event.prompt_index))
            logger.warning("%s: prompt %d not delivered: %s", self._request.request_id, event.prompt_index, event.reason)

    async def _forward(self) -> None:
        forwarder, n = self._stages.forwarder, self._config.n_samples_per_prompt
        groups, self.inbox = batcher.take_pending(self.inbox, forwarder.rows_per_pass(self._config), n)
        forwarded = await forwarder.forward(groups, self._request, self._early)
        if self._early is not None:
            for group in groups:
                self._early.discard(group.prompt_index)
        self.inbox = batcher.add_forwarded(self.inbox, forwarded)

    async def _forward_early(self) -> None:
        """Forward finished samples of groups still generating (the engine is still decoding their siblings)."""
        assert self._early is not None, "no SampleFinished events are kept without early forwards"
        forwarder = self._stages.forwarder
        samples, self.inbox = batcher.take_finished_samples(self.inbox, forwarder.rows_per_pass(self._config))
        await forwarder.forward_samples(samples, self._request, self._early)

    async def _take_batch(self, run: ProducerRun) -> tuple[ForwardedGroup, ...]:
        """The next batch's groups; () when stale groups went back for resampling (or were given up after a
        failure). With ``max_staleness`` s, waits for policy version v0 + b - s first (the trainer's update)."""
        oldest = None
        if self._config.max_staleness is not None:
            oldest = run.start_version + self._batch_index - self._config.max_staleness
            await run.policy.wait_for_version(oldest, self._deadline)
        take = batcher.take_batch(self.inbox, self._config, oldest)
        self.inbox = take.inbox
        if take.abandoned:
            logger.warning("%s: %d stale groups not delivered after a failure",
                           self._request.request_id, len(take.abandoned))
            run.window.end(g.scored.prompt_index for g in take.abandoned)
        if take.resample:
            run.resample([g.scored.prompt_index for g in take.resample])  # (their early rows went with them)
            self._stats.resampled_groups += len(take.resample)
            logger.info("%s: batch %d: %d groups older than version %d resampled",
                        self._request.request_id, self._batch_index, len(take.resample), oldest)
        return take.groups

    async def _estimate(self, groups: tuple[ForwardedGroup, ...]) -> list[Experience]:
        """The batch (or, with rollout scope, the batches) of ``groups``, estimated with the run's state (its
        statistics advanced in one step: :class:`run_statistics.RunStatistics`)."""
        config = self._config
        dropped, self.inbox = batcher.reported_drops(self.inbox)
        with metrics.stage_timer("advantages"):
            batch = self._stages.forwarder.assemble(groups, self._request)

            counted = counted_groups(self._request, batch.rollout.prompt_index)

            def step(state: RunState, already: frozenset[int] = frozenset()) -> tuple[RunState, Experience]:
                experience, state = estimate_experience(
                    batch.rollout, batch.rewards, batch.reward_metrics, batch.forward, config, state,
                    self._batch_index, dropped, None if counted is None else counted.mask(already),
                )
                return state, experience

            if self._statistics is None:
                self._local_state, experience = step(self._local_state)
            else:
                initial = run_statistics.initial_state(config)
                experience = await self._stages.runs.advance(self._statistics, initial, step, counted)
        metrics.observe_distributions(experience)
        self._handled.update(dropped)
        experience = experience._replace(
            actor_policy_version=min(g.actor_version for g in groups),
            resampled_groups=self._stats.resampled_groups - self._resampled_reported,
        )
        self._resampled_reported = self._stats.resampled_groups
        parts = split_experience(experience, config.groups_per_batch)
        self._batch_index += len(parts)
        return parts

    def _in_request_indices(self, part: Experience) -> Experience:
        """``part`` with prompt indices into the request's message (they differ once SKIP left prompts out), and
        the skipped prompts with the first batch's drops."""
        request = self._request
        if not request.prompt_indices:
            return part
        skipped, self._skipped_unreported = self._skipped_unreported, ()
        return part._replace(
            prompt_index=tuple(request.source_index(i) for i in part.prompt_index),
            dropped_prompt_indices=(*skipped, *(request.source_index(i) for i in part.dropped_prompt_indices)),
        )

    def _delivered(self, part: Experience, run: ProducerRun) -> None:
        metrics.EXPERIENCE_SAMPLES.inc(len(part.reward))
        self._handled.update(part.prompt_index)
        run.window.end(part.prompt_index)  # streamed: their leases admit the next prompts


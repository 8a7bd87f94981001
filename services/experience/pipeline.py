"""The experience pipeline: generate -> score each group -> (drop, refill) -> batch -> forward -> estimate -> stream.

Stages are plain functions and small Protocols; gRPC lives only in :mod:`services.experience.clients` and the
servicer. A background task runs the generation rounds: every prompt group is scored as soon as its n samples
finish (while the engine keeps generating), and dynamic sampling drops zero-variance groups and starts a refill
round for the shortfall. The consumer batches scored groups, runs the actor/reference/critic forwards in a worker
thread and the experience math in the event loop, so the first ExperienceBatch streams long before the last
sample is generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.deadlines import Deadline
from services.common.errors import RewardFailed
from services.experience.estimate import estimate_experience
from services.experience.forward import chunks
from services.experience.logprobs import LogProbModel
from services.experience.packing import pack_experience
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


class Scorer(Protocol):
    """Where rewards come from (the scorer service, through :class:`ScorerClient`)."""

    async def score(
        self,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[str],
        references: Sequence[str],
        deadline: Deadline,
    ) -> Scores: ...


@dataclass(frozen=True)
class ForwardModels:
    """The models the experience service runs itself; ``critic`` only when configured (``gae`` needs it)."""

    actor: LogProbModel
    reference: LogProbModel
    critic: ValueModel | None = None
    micro_batch_size: int = 8


@dataclass
class StreamStats:
    """Counters of one ``make_experiences`` call, complete once the stream ends (trailing metadata)."""

    generation_rounds: int = 0
    dropped_groups: int = 0


@dataclass(frozen=True)
class _ScoredGroup:
    completions: tuple[CompletionRecord, ...]  # n, in sample order
    scores: Scores


@dataclass(frozen=True)
class _Dropped:
    prompt_index: int


@dataclass(frozen=True)
class _Done:
    pass


_Item = _ScoredGroup | _Dropped | _Done | BaseException


class ExperienceMaker:
    """Makes experiences; calls may run concurrently (forward passes are serialized, they share the device)."""

    def __init__(
        self,
        generator: Generator,
        scorer: Scorer,
        models: ForwardModels,
        pad_token_id: int,
        runs: RunStore | None = None,
    ) -> None:
        self._generator = generator
        self._scorer = scorer
        self._models = models
        self._pad_token_id = pad_token_id
        self._runs = runs if runs is not None else RunStore()
        self._forward_lock = asyncio.Lock()

    @property
    def has_critic(self) -> bool:
        """Whether a value model runs here (requests for ``gae`` are validated against it)."""
        return self._models.critic is not None

    async def make_experiences(
        self, request: ExperienceRequest, deadline: Deadline, stats: StreamStats | None = None
    ) -> AsyncIterator[Experience]:
        """Yield Experiences of whole prompt groups, each delivered group exactly once, as groups finish.

        Groups scored before a generation failure are still delivered, then the failure is raised. ``stats``
        (optional) is filled in as the stream runs: generation rounds and dynamic-sampling drops.

        Raises:
            NotReady, UpstreamTimeout, InvalidRequest: from the generator or scorer clients.
            RewardFailed: a reward source could not score a group (the message names the prompt and source).
        """
        config = request.config
        stats = stats if stats is not None else StreamStats()
        ready: asyncio.Queue[_Item] = asyncio.Queue()
        producer = asyncio.create_task(self._produce(request, deadline, ready, stats), name=request.request_id)
        local_state = _initial_state(config)
        try:
            batch_index = 0
            dropped: list[int] = []
            finished = False
            failure: BaseException | None = None
            while not finished:
                groups: list[_ScoredGroup] = []
                while len(groups) < config.groups_per_batch:
                    item = await ready.get()
                    if isinstance(item, _Dropped):
                        dropped.append(item.prompt_index)
                        stats.dropped_groups += 1
                        continue
                    if isinstance(item, _Done | BaseException):
                        failure = item if isinstance(item, BaseException) else None
                        finished = True
                        break
                    groups.append(item)
                if not groups:
                    continue
                rollout, forward, rewards, metrics = await self._prepare(groups, request)
                state = self._runs.get(config.run_id, _initial_state(config)) if config.run_id else local_state
                experience, state = estimate_experience(
                    rollout, rewards, metrics, forward, config, state, batch_index, tuple(dropped)
                )
                if config.run_id:
                    self._runs.put(config.run_id, state)
                else:
                    local_state = state
                dropped.clear()
                yield pack_experience(experience) if config.return_packed else experience
                batch_index += 1
            if failure is not None:
                raise failure
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    # ------------------------------------------------------------------------------------------------------------
    # Producer: generation rounds, per-group scoring, dynamic sampling
    # ------------------------------------------------------------------------------------------------------------

    async def _produce(
        self, request: ExperienceRequest, deadline: Deadline, ready: asyncio.Queue[_Item], stats: StreamStats
    ) -> None:
        """Run generation rounds until enough groups are kept (all prompts without dynamic sampling)."""
        dynamic = request.config.dynamic_sampling
        target = dynamic.num_groups if dynamic else len(request.prompts)
        rounds_left = 1 + (dynamic.max_extra_rounds if dynamic else 0)
        next_prompt, kept = 0, 0
        try:
            while kept < target and rounds_left > 0 and next_prompt < len(request.prompts):
                indices = range(next_prompt, min(len(request.prompts), next_prompt + target - kept))
                next_prompt = indices.stop
                rounds_left -= 1
                stats.generation_rounds += 1
                kept += await self._run_round(request, indices, stats.generation_rounds, deadline, ready)
            await ready.put(_Done())
        except Exception as error:  # handed to the consumer, which delivers what is ready, then raises it
            await ready.put(error)

    async def _run_round(
        self,
        request: ExperienceRequest,
        indices: range,
        round_number: int,
        deadline: Deadline,
        ready: asyncio.Queue[_Item],
    ) -> int:
        """Generate ``indices`` prompts, score each group as it completes; return how many groups were kept."""
        n = request.config.n_samples_per_prompt
        generation = GenerationRequest(
            request_id=f"{request.request_id}-r{round_number}",
            prompts=tuple(request.prompts[i].token_ids for i in indices),
            sampling=request.sampling,
            n_samples_per_prompt=n,
        )
        pending: dict[int, list[CompletionRecord]] = {}
        scoring: set[asyncio.Task[bool]] = set()
        try:
            async with contextlib.aclosing(self._generator.generate(generation, deadline)) as records:
                async for record in records:
                    record = dataclasses.replace(record, prompt_index=indices[record.prompt_index])
                    group = pending.setdefault(record.prompt_index, [])
                    group.append(record)
                    if len(group) == n:
                        del pending[record.prompt_index]
                        completions = tuple(sorted(group, key=lambda c: c.sample_index))
                        scoring.add(asyncio.create_task(self._score_group(request, completions, deadline, ready)))
                    for task in [t for t in scoring if t.done()]:
                        task.result()  # a scoring failure stops the round
        except asyncio.CancelledError:
            for task in scoring:
                task.cancel()
            raise
        finally:
            # groups already complete are scored and delivered even when generation failed
            results = await asyncio.gather(*scoring, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return sum(results)

    async def _score_group(
        self,
        request: ExperienceRequest,
        completions: tuple[CompletionRecord, ...],
        deadline: Deadline,
        ready: asyncio.Queue[_Item],
    ) -> bool:
        """Score one group and hand it to the consumer, or drop it (dynamic sampling); True when kept."""
        prompt_index = completions[0].prompt_index
        spec = request.prompts[prompt_index]
        try:
            scores = await self._scorer.score(
                queries=[spec.text + c.text for c in completions],
                prompts=[spec.text] * len(completions),
                labels=[spec.label] * len(completions),
                references=[spec.reference] * len(completions),
                deadline=deadline,
            )
        except RewardFailed as error:
            raise RewardFailed(f"prompt {prompt_index}: {error}") from error
        config = request.config
        if config.dynamic_sampling and bool(zero_variance_groups(scores.rewards, config.n_samples_per_prompt)[0]):
            await ready.put(_Dropped(prompt_index))
            logger.debug("%s: dropped prompt %d (all rewards equal)", request.request_id, prompt_index)
            return False
        await ready.put(_ScoredGroup(completions, scores))
        return True

    # ------------------------------------------------------------------------------------------------------------
    # Consumer: forwards
    # ------------------------------------------------------------------------------------------------------------

    async def _prepare(
        self, groups: list[_ScoredGroup], request: ExperienceRequest
    ) -> tuple[Rollout, ForwardOutputs, torch.Tensor, dict[str, torch.Tensor]]:
        completions = [c for g in groups for c in g.completions]
        rollout = build_rollout(completions, request.prompts, self._pad_token_id)
        rewards = torch.cat([g.scores.rewards.float() for g in groups])
        names = sorted({name for g in groups for name in g.scores.metrics})
        metrics = {
            name: torch.cat([
                g.scores.metrics[name].float() if name in g.scores.metrics
                else torch.full((len(g.completions),), float("nan"))
                for g in groups
            ])
            for name in names
        }
        async with self._forward_lock:
            forward = await asyncio.to_thread(self._forward, rollout, request.config)
        return rollout, forward, rewards, metrics

    def _forward(self, rollout: Rollout, config: ExperienceConfig) -> ForwardOutputs:
        """Actor, reference (and critic) passes over the rollout's rows (runs in a worker thread)."""
        parts = chunks(rollout, self._models.micro_batch_size, packed=config.packing_samples)
        actor, entropy = self._models.actor.action_log_probs(parts, with_entropy=config.return_action_entropy)
        reference, _ = self._models.reference.action_log_probs(parts)
        values = None
        if config.estimator.needs_critic:
            if self._models.critic is None:
                raise ValueError("gae needs a critic")  # request validation rejects this first
            values = self._models.critic.values(parts)
        return ForwardOutputs(actor, reference, values, entropy)


def _initial_state(config: ExperienceConfig) -> RunState:
    kl = config.kl
    return RunState(RunningMoments(), KLController(kl.kl_coef, kl.kl_target, kl.kl_horizon))

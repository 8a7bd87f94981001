"""The experience pipeline: generate -> group -> score -> actor/reference log-probs -> estimate -> stream.

Stages are plain functions and small Protocols; gRPC lives only in :mod:`services.experience.clients` and the
servicer. Generation runs in a background task and keeps the engine's continuous batch full while finished prompt
groups are scored and run through the actor and reference models in a worker thread, so the first
ExperienceBatch streams long before the last sample is generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.deadlines import Deadline
from services.experience.estimate import estimate_experience
from services.experience.logprobs import LogProbModel
from services.experience.request import ExperienceRequest
from services.experience.sequences import build_rollout
from services.experience.types import Experience, Rollout
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
class _GenerationDone:
    pass


class ExperienceMaker:
    """Makes experiences for one request at a time per call; calls may run concurrently."""

    def __init__(
        self, generator: Generator, scorer: Scorer, actor: LogProbModel, reference: LogProbModel, pad_token_id: int
    ) -> None:
        self._generator = generator
        self._scorer = scorer
        self._actor = actor
        self._reference = reference
        self._pad_token_id = pad_token_id
        self._forward_lock = asyncio.Lock()  # one forward batch at a time: they share the CPU/GPU

    async def make_experiences(self, request: ExperienceRequest, deadline: Deadline) -> AsyncIterator[Experience]:
        """Yield Experiences of whole prompt groups, each group exactly once, as groups finish.

        Raises:
            NotReady, UpstreamTimeout, InvalidRequest: from the generator or scorer clients.
        """
        config = request.config
        n = config.n_samples_per_prompt
        generation = GenerationRequest(
            request_id=request.request_id,
            prompts=tuple(p.token_ids for p in request.prompts),
            sampling=request.sampling,
            n_samples_per_prompt=n,
        )
        ready: asyncio.Queue[list[CompletionRecord] | _GenerationDone | BaseException] = asyncio.Queue()

        async def collect_groups() -> None:
            pending: dict[int, list[CompletionRecord]] = {}
            try:
                async with contextlib.aclosing(self._generator.generate(generation, deadline)) as records:
                    async for record in records:
                        group = pending.setdefault(record.prompt_index, [])
                        group.append(record)
                        if len(group) == n:
                            del pending[record.prompt_index]
                            await ready.put(sorted(group, key=lambda c: c.sample_index))
                await ready.put(_GenerationDone())
            except Exception as error:  # handed to the consumer, which raises it
                await ready.put(error)

        collector = asyncio.create_task(collect_groups(), name=f"generate-{request.request_id}")
        try:
            batch_index = 0
            failure: BaseException | None = None
            finished = False
            while not finished:
                groups: list[list[CompletionRecord]] = []
                while len(groups) < config.groups_per_batch:
                    item = await ready.get()
                    if isinstance(item, BaseException | _GenerationDone):
                        failure = item if isinstance(item, BaseException) else None
                        finished = True
                        break
                    groups.append(item)
                if groups:  # groups completed before a generation failure are still delivered
                    yield await self._process(request, [c for g in groups for c in g], batch_index, deadline)
                    batch_index += 1
            if failure is not None:
                raise failure
        finally:
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)

    async def _process(
        self, request: ExperienceRequest, completions: list[CompletionRecord], batch_index: int, deadline: Deadline
    ) -> Experience:
        rollout = build_rollout(completions, request.prompts, self._pad_token_id)
        specs = [request.prompts[c.prompt_index] for c in completions]
        scoring = asyncio.create_task(
            self._scorer.score(
                queries=[p + r for p, r in zip(rollout.prompt_texts, rollout.response_texts, strict=True)],
                prompts=list(rollout.prompt_texts),
                labels=[s.label for s in specs],
                references=[s.reference for s in specs],
                deadline=deadline,
            )
        )
        try:
            async with self._forward_lock:
                action_log_probs, base_action_log_probs = await asyncio.to_thread(self._forward, rollout)
            scores = await scoring
        finally:
            scoring.cancel()
        return estimate_experience(
            rollout, scores.rewards, scores.metrics, action_log_probs, base_action_log_probs, request.config,
            batch_index,
        )

    def _forward(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Actor and reference log-probs of the response tokens, each (B, A) float32 (runs in a worker thread)."""
        num_actions = rollout.action_mask.shape[1]
        actor = self._actor.action_log_probs(rollout.sequences, rollout.attention_mask, num_actions)
        reference = self._reference.action_log_probs(rollout.sequences, rollout.attention_mask, num_actions)
        return actor, reference

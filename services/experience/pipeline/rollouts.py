"""Rollouts: how a round's prompt groups become scored groups, one implementation per kind, chosen from a registry.

A round of prompt indices is handed to the rollout the request's kind names (:func:`rollout_kind`):

- ``single_turn``: one generation request for the whole round; each group is scored by the scorer as soon as its n
  samples are in, while the engine keeps generating the others.
- ``episodes``: each sample is a multi-turn episode in the scorer's environment
  (:class:`~services.experience.pipeline.episodes.EpisodeRunner`); the environment gives the reward.
- ``agent``: each sample is one call of the operator's agent server, its model calls recorded by the gateway
  (:class:`~services.experience.pipeline.events.Agents`); the agent gives the reward, or leaves it to the scorer.

Every rollout hands each finished group to the producer's ``hand_on`` (which keeps or drops it) and reports a group
whose episode failed as :class:`~services.experience.pipeline.events.GroupFailed`: a failure costs its group only.
New kinds register with :func:`register` (the shape of verl's ``AgentLoopBase`` + ``@register``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common import metrics
from services.common.errors import EpisodeFailed, RewardFailed
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.config import ExperienceConfig
from services.experience.pipeline.episodes import EpisodeRunner
from services.experience.pipeline.events import (
    AgentEpisode,
    Agents,
    Generator,
    GroupFailed,
    GroupsRerouted,
    Rerouted,
    SampleFinished,
    SamplePreview,
    ScoreBatch,
    Scorer,
    Scores,
)

if TYPE_CHECKING:
    from services.experience.pipeline.producer import ProducerRun

#: Hands a finished group (its rows, in sample order, and their scores) to the producer; True when kept.
HandOn = Callable[[tuple[CompletionRecord, ...], Scores], Awaitable[bool]]


@dataclass(frozen=True)
class RolloutParts:
    """What rollouts reach: the generator, the scorer, and the episode and agent runners this service has."""

    generator: Generator
    scorer: Scorer
    episodes: EpisodeRunner | None = None
    agents: Agents | None = None


def rollout_kind(config: ExperienceConfig) -> str:
    """The registered rollout a request runs (pure)."""
    if config.agent is not None:
        return "agent"
    return "episodes" if config.episodes is not None else "single_turn"


class Rollout(abc.ABC):
    """One round's groups: :meth:`consume` runs them, handing each group on as it finishes; ``complete`` holds the
    prompt indices whose groups finished (scored, dropped or failed), so an aborted round knows what to resample."""

    def __init__(self, run: ProducerRun, indices: Sequence[int], parts: RolloutParts, hand_on: HandOn,
                 resampled: bool) -> None:
        self._run, self._indices, self._parts, self._hand_on = run, indices, parts, hand_on
        self._resampled = resampled  # a failed group is then one the consumer awaits: say so
        self.complete: set[int] = set()
        self._tasks: list[asyncio.Task[bool]] = []

    @abc.abstractmethod
    async def consume(self) -> None:
        """Run the round's groups; returns once every group's task has started (generation errors are raised)."""

    def cancel(self) -> None:
        """Cancel the groups still running (the round was aborted or the stream ended)."""
        for task in self._tasks:
            task.cancel()

    async def outcomes(self) -> list[bool | BaseException]:
        """Each group's outcome (kept or not) or error, once all are done."""
        return await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _fail_group(self, prompt_index: int, error: EpisodeFailed) -> bool:
        """Report a group whose episode failed; its window lease admits the next prompt now."""
        self.complete.add(prompt_index)
        await self._run.events.put(GroupFailed(prompt_index, str(error), resampled=self._resampled))
        self._run.window.end((prompt_index,))
        return False


ROLLOUTS: dict[str, type[Rollout]] = {}


def register(kind: str) -> Callable[[type[Rollout]], type[Rollout]]:
    """Register a :class:`Rollout` under ``kind`` (the name :func:`rollout_kind` returns)."""

    def add(cls: type[Rollout]) -> type[Rollout]:
        if kind in ROLLOUTS:
            raise ValueError(f"a rollout {kind!r} is registered already ({ROLLOUTS[kind].__name__})")
        ROLLOUTS[kind] = cls
        return cls

    return add


async def score_texts(scorer: Scorer, run: ProducerRun, prompt_index: int, responses: Sequence[str]) -> Scores:
    """The scorer's rewards of ``responses`` to one prompt.

    Raises:
        RewardFailed: naming the prompt.
    """
    spec, n = run.request.prompts[prompt_index], len(responses)
    batch = ScoreBatch(
        queries=tuple(spec.text + r for r in responses), prompts=(spec.text,) * n, labels=(spec.label,) * n,
        references=(spec.reference,) * n, media=(spec.media,) * n if spec.media is not None else (),
    )
    try:
        with metrics.stage_timer("score"):
            return await scorer.score(batch, run.deadline)
    except RewardFailed as error:
        raise RewardFailed(f"prompt {prompt_index}: {error}") from error


@register("single_turn")
class SingleTurnRollout(Rollout):
    """One generation request for the round; each group scored as its last sample arrives."""

    async def consume(self) -> None:
        request, n = self._run.request, self._run.request.config.n_samples_per_prompt
        generation = GenerationRequest(
            request_id=f"{request.request_id}-r{next(self._run.round_ids)}",
            prompts=tuple(request.prompts[i].token_ids for i in self._indices),
            sampling=request.sampling,
            n_samples_per_prompt=n,
            media=tuple(request.prompts[i].media for i in self._indices),
            adapter=request.adapter,
        )
        pending: dict[int, list[CompletionRecord]] = {}
        started = time.perf_counter()
        generator = self._parts.generator
        async with contextlib.aclosing(generator.generate(generation, self._run.deadline)) as records:
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
                    self._run.share.give_back((record.prompt_index,))  # its samples are in: capacity frees
                    del pending[record.prompt_index]
                    self.complete.add(record.prompt_index)
                    completions = tuple(sorted(group, key=lambda c: c.sample_index))
                    self._tasks.append(asyncio.create_task(self._score(completions)))
                for task in [t for t in self._tasks if t.done()]:
                    task.result()  # a scoring failure stops the round

    async def _score(self, completions: tuple[CompletionRecord, ...]) -> bool:
        prompt_index = completions[0].prompt_index
        scores = await score_texts(self._parts.scorer, self._run, prompt_index, [c.text for c in completions])
        return await self._hand_on(completions, scores)


class GroupwiseRollout(Rollout):
    """A rollout whose groups run independently: each group's episodes are run by :meth:`_episodes` and the group
    is handed on as soon as they are done (no turn-synchronous barrier); a group whose episode failed is reported
    and the round goes on."""

    async def consume(self) -> None:
        self._tasks = [asyncio.create_task(self._group(index)) for index in self._indices]
        await asyncio.wait(self._tasks)

    @abc.abstractmethod
    async def _episodes(self, prompt_index: int) -> tuple[tuple[CompletionRecord, ...], Scores]:
        """The group's rows (in sample order) and their scores.

        Raises:
            EpisodeFailed: an episode failed (the group's others are cancelled).
        """

    async def _group(self, prompt_index: int) -> bool:
        started = time.perf_counter()
        try:
            rows, scores = await self._episodes(prompt_index)
        except EpisodeFailed as error:
            return await self._fail_group(prompt_index, error)
        finally:
            self._run.share.give_back((prompt_index,))  # its episodes are over: capacity frees
        metrics.STAGE_SECONDS.labels("episodes").observe(time.perf_counter() - started)
        self.complete.add(prompt_index)
        return await self._hand_on(rows, scores)


@register("episodes")
class EpisodeRollout(GroupwiseRollout):
    """Each group's n episodes in the scorer's environment (:class:`EpisodeRunner`), which gives the rewards."""

    async def _episodes(self, prompt_index: int) -> tuple[tuple[CompletionRecord, ...], Scores]:
        if self._parts.episodes is None:
            raise RuntimeError("an episode request reached a producer without an episode runner")
        return await self._parts.episodes.run_group(self._run.request, prompt_index, self._run.deadline)


@register("agent")
class AgentRollout(GroupwiseRollout):
    """Each group's n agent episodes, run concurrently and handed on together as one group of rows.

    An episode the agent's framework split (drift) gives several consecutive rows of the same sample, each carrying
    the episode's reward and metrics (group statistics are taken over episodes: :func:`fastexp.rl.estimate.
    estimate_experience`). Episodes whose reward the agent left unset are scored by the scorer on their last reply.
    """

    async def _episodes(self, prompt_index: int) -> tuple[tuple[CompletionRecord, ...], Scores]:
        episodes = await self._run_agents(prompt_index)
        return episode_rows(episodes, await self._rewards(prompt_index, episodes))

    async def _run_agents(self, prompt_index: int) -> list[AgentEpisode]:
        """The group's n episodes; the first failure cancels the others and is raised."""
        agents, request = self._parts.agents, self._run.request
        if agents is None or request.config.agent is None:
            raise RuntimeError("an agent request reached a producer without agents")
        options, spec = request.config.agent, request.prompts[prompt_index]
        messages = [{"role": r, "content": c} for r, c in spec.messages] or [{"role": "user", "content": spec.text}]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(agents.run_episode(
                    options.name, messages, spec.text, spec.reference, spec.label, prompt_index, sample,
                    self._run.deadline, options.max_calls,
                )) for sample in range(request.config.n_samples_per_prompt)]
        except BaseExceptionGroup as failures:
            raise failures.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _rewards(self, prompt_index: int, episodes: Sequence[AgentEpisode]) -> list[float]:
        """Each episode's reward: the agent's, or the scorer's on its last reply where the agent gave none."""
        unscored = [i for i, e in enumerate(episodes) if e.reward is None]
        rewards = [e.reward if e.reward is not None else 0.0 for e in episodes]
        if unscored:
            scores = await score_texts(self._parts.scorer, self._run, prompt_index,
                                       [episodes[i].final_text for i in unscored])
            for position, i in enumerate(unscored):
                rewards[i] = float(scores.rewards[position])
        return rewards


def episode_rows(episodes: Sequence[AgentEpisode], rewards: Sequence[float]) -> tuple[
        tuple[CompletionRecord, ...], Scores]:
    """A group's episodes as rows in sample order and their :class:`Scores`, each row carrying its episode's
    reward and metrics (NaN where an episode lacks a metric others have).

    Shape: rows R = sum of the episodes' rows (R = n without drift); rewards (R,) float32; each metric (R,).
    """
    rows = tuple(row for e in episodes for row in e.rows)
    repeat = [len(e.rows) for e in episodes]
    names = sorted({name for e in episodes for name in e.metrics})
    per_episode = {name: [e.metrics.get(name, float("nan")) for e in episodes] for name in names}

    def broadcast(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor([v for v, times in zip(values, repeat, strict=True) for _ in range(times)],
                            dtype=torch.float32)

    return rows, Scores(broadcast(rewards), {name: broadcast(values) for name, values in per_episode.items()})

"""Multi-turn episodes, token-exact: model turn -> environment -> model turn ... -> reward, as one experience row.

Each sample of a prompt group is an episode in the scorer's environment (:class:`~services.experience.pipeline.events.
Environments`). The episode is kept as token ids from start to end:

- the model's sampled tokens are appended exactly as the generator returned them (never decoded and re-encoded);
  their text goes to the environment only;
- each observation is rendered with the policy's chat template (:class:`ObservationRenderer`: the tokens the
  template puts after the model's end-of-turn token, then the observation message and the next generation prompt)
  and appended as ids; the next turn is generated from the whole sequence (the engine's prefix cache makes the
  earlier turns cheap);
- ``action_mask`` is 1 exactly on sampled tokens and 0 on observation tokens, ``output_log_probs`` the engine's on
  sampled tokens and 0 on observations, so log-probs, KL and advantages follow the mask downstream.

Budgets: ``max_turns`` model turns, ``max_total_tokens`` response tokens (turns and observations), and the model's
length. An episode that reaches a budget before the environment says ``done``, or whose turn was cut off without
an end-of-turn token, ends as truncated with reward 0 (metric ``truncated`` = 1).

Episodes run independently: each awaits only its own turns and steps, so while one waits for a tool the engine
serves the others, and a group is handed on as soon as its n episodes are done (no turn-synchronous barrier).
Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.deadlines import Deadline
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.config import EpisodeOptions, ExperienceRequest
from services.experience.pipeline.events import Environments, Generator, Scores

_BASE = [{"role": "user", "content": "."}]


class ObservationRenderer:
    """Token ids of environment observations as the policy's chat template renders them.

    Computed as differences of template renderings (the way verl's and SkyRL's agent loops do): with ``B`` the
    rendering of a one-message conversation and ``F`` that conversation plus the observation and a generation
    prompt, the observation's ids are ``F[len(B):]``, preceded by the ids the template writes after an
    end-of-turn token (``"\\n"`` for ChatML) when they follow a model turn.

    Raises:
        ValueError: (at construction or per observation) a template whose renderings are not prefixes of each
            other, or without the tokenizer's EOS token: its observations cannot be appended token-exactly.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._base = self._ids(_BASE, generation_prompt=False)
        with_prompt = self._ids(_BASE, generation_prompt=True)
        if with_prompt[: len(self._base)] != self._base:
            raise ValueError("the chat template's generation prompt does not extend the conversation's rendering")
        self.generation_prompt = with_prompt[len(self._base):]
        eos = tokenizer.eos_token_id
        ends = [i for i, token in enumerate(self._base) if token == eos]
        if not ends:
            raise ValueError("the chat template does not end a turn with the tokenizer's EOS token")
        self.after_turn = self._base[ends[-1] + 1:]  # what the template writes after an end-of-turn token

    def observation_ids(self, text: str, role: str) -> list[int]:
        """The ids of one observation message in ``role`` and the next generation prompt (no separator)."""
        full = self._ids([*_BASE, {"role": role, "content": text}], generation_prompt=True)
        if full[: len(self._base)] != self._base:
            raise ValueError(f"the chat template renders a {role!r} message by rewriting the conversation before it")
        return full[len(self._base):]

    def _ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Episode:
    """One finished episode: its row (a :class:`CompletionRecord` with ``action_mask``), reward and metrics."""

    record: CompletionRecord
    reward: float
    metrics: dict[str, float]


@dataclass
class _Trace:
    """An episode's token ids so far (after the prompt) and what is known about each."""

    ids: list[int]  # the whole sequence: prompt, then turns and observations
    response: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0

    def add(self, ids: Sequence[int], sampled: bool, log_probs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.response.extend(ids)
        self.mask.extend([int(sampled)] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))


def tenant_of(request: ExperienceRequest) -> str:
    """Whose share of the scorer's tool sandbox ``request``'s episodes use (``StartEpisodeRequest.tenant``): the
    same key as its share of the generator (``request.share_key``); a key past the field's 256 bytes is sent as its
    SHA-256 (hex)."""
    key = request.share_key
    return key if len(key.encode()) <= 256 else hashlib.sha256(key.encode()).hexdigest()


class EpisodeRunner:
    """Runs the episodes of prompt groups over a generator and the environments (module docs)."""

    def __init__(self, generator: Generator, environments: Environments, renderer: ObservationRenderer,
                 max_model_len: Callable[[], int], tokenizer: Any) -> None:
        """``max_model_len()``: the generator's limit on prompt + response tokens (read per episode)."""
        self._generator = generator
        self._environments = environments
        self._renderer = renderer
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer

    async def run_group(
        self, request: ExperienceRequest, prompt_index: int, deadline: Deadline
    ) -> tuple[tuple[CompletionRecord, ...], Scores]:
        """The group's n episodes, run concurrently, as rows and the environment's rewards and metrics.

        Raises:
            EpisodeFailed: an episode failed in its environment (the group's other episodes are cancelled).
            NotReady, UpstreamTimeout, InvalidRequest: from the generator or the environment service.
        """
        n = request.config.n_samples_per_prompt
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.run_episode(request, prompt_index, s, deadline)) for s in range(n)]
        except BaseExceptionGroup as failures:  # the first failure cancelled the others: raise it as it is
            raise failures.exceptions[0] from None
        episodes = [task.result() for task in tasks]
        names = sorted({name for e in episodes for name in e.metrics})
        metrics = {name: torch.tensor([e.metrics.get(name, math.nan) for e in episodes], dtype=torch.float32)
                   for name in names}
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        return tuple(e.record for e in episodes), Scores(rewards, metrics)

    async def run_episode(
        self, request: ExperienceRequest, prompt_index: int, sample_index: int, deadline: Deadline
    ) -> Episode:
        """One episode from the prompt to the environment's ``done`` or a budget (module docs)."""
        spec, options = request.prompts[prompt_index], request.config.episodes
        assert options is not None, "an episode needs the request's environment"
        session, first, role = await self._environments.start(
            options.environment, spec.text, spec.reference, spec.label, options.max_turns, deadline,
            tenant=tenant_of(request),
        )
        trace, closed = _Trace(list(spec.token_ids)), False
        try:
            if first is not None:  # before the first turn: in place of the prompt's generation prompt
                trace.ids[len(trace.ids) - len(self._renderer.generation_prompt):] = []
                trace.add(self._renderer.observation_ids(first, role), sampled=False)
            reward, metrics, closed = await self._turns(
                request, prompt_index, options, sample_index, session, trace, deadline
            )
        finally:
            if not closed:
                with contextlib.suppress(asyncio.CancelledError):
                    await self._environments.end(session)
        record = CompletionRecord(
            prompt_index=prompt_index, sample_index=sample_index, prompt_token_ids=spec.token_ids,
            output_token_ids=tuple(trace.response), output_log_probs=np.asarray(trace.log_probs, dtype=np.float32),
            finish_reason="stop" if not metrics.get("truncated") else "length",
            text=self._tokenizer.decode(trace.response, skip_special_tokens=False),
            policy_version=min(trace.versions) if trace.versions else 0,
            action_mask=tuple(trace.mask), num_turns=trace.turns,
        )
        return Episode(record, reward, {**metrics, "num_turns": float(trace.turns)})

    async def _turns(
        self, request: ExperienceRequest, prompt_index: int, options: EpisodeOptions, sample_index: int,
        session: str, trace: _Trace, deadline: Deadline,
    ) -> tuple[float, dict[str, float], bool]:
        """Alternate model turns and environment steps; returns (reward, metrics, session closed)."""
        max_model_len = self._max_model_len()
        total_limit = options.max_total_tokens or max_model_len
        metrics: dict[str, float] = {}
        while trace.turns < options.max_turns:
            budget = min(request.sampling.max_new_tokens, total_limit - len(trace.response),
                         max_model_len - len(trace.ids))
            if budget < 1:
                break
            completion = await self._sample(request, prompt_index, sample_index, trace, budget, deadline)
            trace.add(completion.output_token_ids, sampled=True, log_probs=completion.output_log_probs.tolist())
            trace.versions.append(completion.policy_version)
            trace.turns += 1
            step = await self._environments.step(session, completion.text, deadline)
            metrics = dict(step.metrics)
            if step.done:
                return float(step.reward or 0.0), {**metrics, "truncated": 0.0}, True
            if completion.finish_reason != "stop" or step.observation is None:
                break  # the turn was cut off: the conversation cannot go on token-exactly
            observation = [*self._renderer.after_turn, *self._renderer.observation_ids(step.observation, step.role)]
            too_long = len(trace.ids) + len(observation) >= max_model_len
            if too_long or len(trace.response) + len(observation) >= total_limit:
                break
            trace.add(observation, sampled=False)
        return 0.0, {**metrics, "truncated": 1.0}, False

    async def _sample(
        self, request: ExperienceRequest, prompt_index: int, sample_index: int, trace: _Trace, budget: int,
        deadline: Deadline,
    ) -> CompletionRecord:
        """One model turn from the whole sequence so far (its own seed: seed + sample + turn x n)."""
        sampling, n = request.sampling, request.config.n_samples_per_prompt
        seed = None if sampling.seed is None else sampling.seed + sample_index + trace.turns * n
        turn = GenerationRequest(
            request_id=f"{request.request_id}-p{prompt_index}-e{sample_index}-t{trace.turns}",
            prompts=(tuple(trace.ids),), sampling=dataclasses.replace(sampling, max_new_tokens=budget, seed=seed),
            n_samples_per_prompt=1,
            # the episode's earlier turns are in one replica's prefix cache: its turns go back there (fleet routing)
            affinity_key=f"{request.request_id}/{prompt_index}/{sample_index}",
            adapter=request.adapter,
        )
        async with contextlib.aclosing(self._generator.generate(turn, deadline)) as records:
            async for record in records:
                if isinstance(record, CompletionRecord):
                    return record
        raise RuntimeError("the generator ended a turn without a completion")

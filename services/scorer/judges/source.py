"""An LLM judge as a reward source: render each item's prompt, send calls through the gateway, parse verdicts.

Per item: reward = :func:`~services.scorer.judges.verdicts.to_reward` of the parsed verdict; metrics ``score``
(the raw verdict), ``prompt_tokens``, ``completion_tokens`` (of the item's own judgement). An item fails, naming
the judge, its endpoint and its breaker's state, when its call failed (after retries), was refused by the open
breaker, queued past the deadline, or when the answer has no usable verdict (the answer is quoted). Each answer is
logged on ``services.scorer.judges.answers`` (INFO) with the item's cache key, for inspection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from services.common.deadlines import Deadline
from services.common.errors import UpstreamTimeout
from services.common.metrics import JUDGE_UNPARSED_VERDICTS, SOURCE_TOKENS
from services.scorer.judges.backends import Chat, JudgeBackend, JudgeReply, build_backend
from services.scorer.judges.config import JudgeConfig
from services.scorer.judges.verdicts import parse_verdict, render, to_reward
from services.scorer.outbound.breaker import Breaker, BreakerOpen
from services.scorer.outbound.cache import cache_key, fingerprint
from services.scorer.outbound.guard import CallGuard, SourceRejected, SourceUnavailable, after_tries
from services.scorer.scorer import NO_DEADLINE, ScoreItem, SourceScores

answers_log = logging.getLogger("services.scorer.judges.answers")

#: Characters per token assumed when estimating a call's tokens for the tokens/min budget.
CHARS_PER_TOKEN = 4


class JudgeScorer:
    """A :class:`~services.scorer.scorer.RewardSource` over a judge backend (module docs).

    Args:
        backend: where prompts go; None builds the one ``config`` names.
        clock: the breaker's monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, config: JudgeConfig, backend: JudgeBackend | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = config.name
        self._config = config
        self._backend = backend or build_backend(config)
        self._gateway = CallGuard(config.name, config.budget, config.breaker, clock=clock)
        self._fingerprint = fingerprint(config, config.cache.version)

    @property
    def breaker(self) -> Breaker:
        """This judge's circuit breaker (its one owner is this source)."""
        return self._gateway.breaker

    async def start(self) -> None:
        await self._backend.start()

    async def close(self) -> None:
        await self._backend.close()

    def chat(self, item: ScoreItem) -> Chat:
        """The messages judging ``item``."""
        fields = {"prompt": item.prompt, "response": item.response, "reference": item.reference, "label": item.label}
        return Chat(self._config.system, render(self._config.template, fields))

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Judge every item in calls of ``prompts_per_call`` (concurrently, within the budget)."""
        size = self._backend.prompts_per_call
        parts = await asyncio.gather(
            *(self._score_call(items[i : i + size], deadline) for i in range(0, len(items), size))
        )
        return SourceScores.joined(parts)

    async def _score_call(self, items: Sequence[ScoreItem], deadline: Deadline) -> SourceScores:
        config, backend = self._config, self._backend
        chats = [self.chat(item) for item in items]
        tokens = sum(len(chat.system) + len(chat.user) for chat in chats) // CHARS_PER_TOKEN
        tokens += config.answer_tokens * len(chats)
        where = f"{self.name} ({backend.where})"

        try:
            replies = await self._gateway.call(
                lambda timeout_s: backend.complete(chats, timeout_s), tokens=tokens, deadline=deadline,
                timeout_s=config.timeout_s, max_attempts=config.max_attempts,
                backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s,
            )
        except BreakerOpen as error:
            return SourceScores.all_failed(len(items), f"{where}: {error}")
        except SourceUnavailable as error:
            return SourceScores.all_failed(
                len(items), f"{where}: {error} ({after_tries(error)}; {self._gateway.describe()})"
            )
        except (SourceRejected, UpstreamTimeout) as error:
            return SourceScores.all_failed(len(items), f"{where}: {error} ({self._gateway.describe()})")
        return self._verdicts(items, replies, where)

    def _verdicts(self, items: Sequence[ScoreItem], replies: list[JudgeReply], where: str) -> SourceScores:
        config = self._config
        n = len(items)
        rewards = np.full(n, np.nan, np.float32)
        scores = np.full(n, np.nan, np.float32)
        errors: list[str | None] = [None] * n
        SOURCE_TOKENS.labels(self.name, "prompt").inc(sum(reply.prompt_tokens for reply in replies))
        SOURCE_TOKENS.labels(self.name, "completion").inc(sum(reply.completion_tokens for reply in replies))
        for i, (item, reply) in enumerate(zip(items, replies, strict=True)):
            verdict = parse_verdict(reply.text, config.verdict, reply.first_token_logprobs)
            reward = None if verdict.score is None else to_reward(verdict.score, config.score_range,
                                                                 config.reward_range)
            if verdict.score is not None:
                scores[i] = verdict.score
            if reward is None:
                JUDGE_UNPARSED_VERDICTS.labels(self.name).inc()
                errors[i] = f"{where}: {verdict.error or f'verdict {verdict.score} outside {config.score_range}'}"
            else:
                rewards[i] = reward
            if answers_log.isEnabledFor(logging.INFO):
                key = cache_key(self._fingerprint, item.prompt, item.response, item.reference, item.label)
                answers_log.info("judge %s item %s: score %s reward %s answer %r", self.name, key[:16],
                                 verdict.score, reward, reply.text)
        metrics = {
            "score": scores,
            "prompt_tokens": np.array([reply.prompt_tokens for reply in replies], np.float32),
            "completion_tokens": np.array([reply.completion_tokens for reply in replies], np.float32),
        }
        return SourceScores(rewards, metrics, tuple(errors))

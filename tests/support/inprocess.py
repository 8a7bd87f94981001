"""Small real implementations of the pipeline's Generator and Scorer protocols, for in-process stage tests: the
HF engine called directly (as the generator service calls it) and math-verify called directly (no worker pool)."""

from __future__ import annotations

import torch

from services.common.weights import ReceivedUpdate
from services.experience.events import ScoreBatch, Scores
from services.generator.hf_engine import HFEngine
from services.scorer.rules import math_verify_reward


class InProcessGenerator:
    """The engine called directly, as the generator service would (the deadline is the service's concern)."""

    def __init__(self, engine: HFEngine) -> None:
        self._engine = engine

    def generate(self, request, deadline):
        return self._engine.generate(request)

    async def update_weights(self, update: ReceivedUpdate, deadline, version: int | None = None) -> int:
        return await self._engine.update_weights(update.kind, update.folder, version)


class InProcessRuleScorer:
    """math-verify called directly (no worker pool), for in-process pipeline tests."""

    async def score(self, batch: ScoreBatch, deadline) -> Scores:
        columns = zip(batch.queries, batch.prompts, batch.references, strict=True)
        results = [math_verify_reward(query[len(prompt):], reference) for query, prompt, reference in columns]
        return Scores(torch.tensor([r for r, _ in results]), {})

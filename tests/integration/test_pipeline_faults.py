"""ExperienceMaker when generation fails midway: groups completed before the failure are still delivered."""

from __future__ import annotations

import pytest
import torch

from services.common.deadlines import Deadline
from services.common.errors import NotReady
from services.common.sampling import SamplingOptions
from services.experience.advantages import get_estimator
from services.experience.logprobs import LogProbModel
from services.experience.pipeline import ExperienceMaker, Scores
from services.experience.request import ExperienceConfig, ExperienceRequest, PromptSpec
from services.generator.hf_engine import HFEngine
from services.scorer.rules import math_verify_reward


class FailingAfter:
    """The real HF engine, with a fault injected: the stream breaks after ``limit`` completions."""

    def __init__(self, engine: HFEngine, limit: int) -> None:
        self._engine = engine
        self._limit = limit

    async def generate(self, request, deadline):
        count = 0
        async for record in self._engine.generate(request):
            if count == self._limit:
                raise NotReady("generator: UNAVAILABLE: connection lost")
            count += 1
            yield record


class InProcessRuleScorer:
    """math-verify called directly (no worker pool), for in-process pipeline tests."""

    async def score(self, queries, prompts, labels, references, deadline):
        results = [math_verify_reward(q[len(p):], r) for q, p, r in zip(queries, prompts, references, strict=True)]
        return Scores(torch.tensor([r for r, _ in results]), {})


async def test_groups_finished_before_a_generation_failure_are_delivered(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu", micro_batch_size=4)
    maker = ExperienceMaker(FailingAfter(engine, limit=4), InProcessRuleScorer(), model, model, pad_token_id=2)
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(4))
    request = ExperienceRequest(
        "fault", prompts, SamplingOptions(max_new_tokens=4),
        ExperienceConfig(2, 8, get_estimator("rloo"), 0.0, "k1", False, 1.0),  # 4 groups per batch
    )
    delivered = []
    with pytest.raises(NotReady, match="connection lost"):
        async for experience in maker.make_experiences(request, Deadline()):
            delivered.extend(experience.prompt_index)
    # HF generates in chunks of 2 sequences = one group each; 4 completions = groups 0 and 1, which wait for a
    # full batch (4 groups) when the failure comes
    assert sorted(delivered) == [0, 0, 1, 1]

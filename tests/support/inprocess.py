"""Small real implementations of the pipeline's Generator and Scorer protocols, for in-process stage tests: the
HF engine called directly (as the generator service calls it) and math-verify called directly (no worker pool)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from fastexp.v1 import generation_pb2_grpc
from services.common.weights import ReceivedUpdate
from services.experience.pipeline.events import ScoreBatch, Scores
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.rules import math_verify_reward


class Recording:
    """Wraps an engine's ``generate`` to keep every completion it sampled (what tests compare streamed rows with)."""

    def __init__(self, engine: HFEngine) -> None:
        self.completions = []
        self._generate = engine.generate
        engine.generate = self.generate

    async def generate(self, request, adapter=None):
        async for record in self._generate(request, adapter=adapter):
            self.completions.append(record)
            yield record


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


@contextlib.asynccontextmanager
async def serving_generator(
    engine: HFEngine, max_model_len: int, **settings: Any
) -> AsyncIterator[tuple[generation_pb2_grpc.GenerationServiceStub, str]]:
    """The real generator service in process on port 0 over ``engine`` (further ``GeneratorSettings`` fields in
    ``settings``): its stub and address; the service and the engine are closed on exit."""
    running = await start_generator(GeneratorSettings(port=0, max_model_len=max_model_len, **settings), engine)
    address = f"127.0.0.1:{running.port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield generation_pb2_grpc.GenerationServiceStub(channel), address
    finally:
        await channel.close()
        await running.stop(1)
        await engine.close()

"""gRPC adapter of the experience service: decode the request, run the pipeline, encode each batch."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from fastexp.v1 import experience_pb2, experience_pb2_grpc
from services.common.deadlines import Deadline
from services.common.sampling import RequestLimits
from services.experience.pipeline import ExperienceMaker, StreamStats
from services.experience.request import decode_request
from services.experience.wire import experience_to_pb


class ExperienceServicer(experience_pb2_grpc.ExperienceServiceServicer):
    """``fastexp.v1.ExperienceService`` over an :class:`ExperienceMaker`."""

    def __init__(self, maker: ExperienceMaker, tokenizer: Any, limits: RequestLimits, max_model_len: int) -> None:
        self._maker = maker
        self._tokenizer = tokenizer
        self._limits = limits
        self._max_model_len = max_model_len

    async def MakeExperiences(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.MakeExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[experience_pb2.ExperienceBatch]:
        decoded = decode_request(
            request, self._tokenizer, self._limits, self._max_model_len, has_critic=self._maker.has_critic
        )
        deadline = Deadline.from_remaining(context.time_remaining())
        stats = StreamStats()
        try:
            async with contextlib.aclosing(self._maker.make_experiences(decoded, deadline, stats)) as experiences:
                async for experience in experiences:
                    yield experience_to_pb(experience)
        finally:
            context.set_trailing_metadata((
                ("fastexp-dropped-groups", str(stats.dropped_groups)),
                ("fastexp-generation-rounds", str(stats.generation_rounds)),
            ))

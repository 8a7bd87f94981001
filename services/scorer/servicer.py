"""gRPC adapter of the scorer: decode, score, encode."""

from __future__ import annotations

import logging

import grpc

from fastexp.tensor_codec import from_numpy
from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.media_wire import media_from_pb
from services.scorer.composition import RewardComposer
from services.scorer.scorer import make_items
from services.scorer.settings import ScorerSettings

logger = logging.getLogger(__name__)


class ScoringServicer(scoring_pb2_grpc.ScoringServiceServicer):
    """``fastexp.v1.ScoringService`` over a :class:`RewardComposer`."""

    def __init__(self, composer: RewardComposer, settings: ScorerSettings) -> None:
        self._composer = composer
        self._settings = settings

    async def Score(  # noqa: N802 - gRPC method name
        self, request: scoring_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> scoring_pb2.ScoreResponse:
        if len(request.queries) > self._settings.max_queries_per_request:
            raise InvalidRequest("queries", f"at most {self._settings.max_queries_per_request} per request")
        items = make_items(
            request.queries, request.prompts, request.labels, request.references,
            [media_from_pb(m.images, m.videos) for m in request.media],
        )
        logger.debug("score %d items", len(items))
        result = await self._composer.score(items, Deadline.from_remaining(context.time_remaining()))
        return scoring_pb2.ScoreResponse(
            rewards=from_numpy(result.rewards),
            metrics={name: from_numpy(values) for name, values in result.metrics.items()},
            errors=[error or "" for error in result.errors] if any(result.errors) else [],
        )

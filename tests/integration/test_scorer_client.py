"""ScorerClient against a real gRPC server that fails: UNAVAILABLE is retried within the budget, others are not."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fastexp.tensor_codec import from_numpy
from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.channels import open_channel
from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest, NotReady
from services.experience.fleet.clients import ScorerClient
from services.experience.pipeline.events import ScoreBatch


class FlakyScoring(scoring_pb2_grpc.ScoringServiceServicer):
    """Fault injection: the first ``failures`` calls end with ``code``; later calls score every query 1.0."""

    def __init__(self, failures: int, code: grpc.StatusCode) -> None:
        self.calls = 0
        self._failures = failures
        self._code = code

    async def Score(self, request, context):  # noqa: N802 - gRPC method name
        self.calls += 1
        if self.calls <= self._failures:
            await context.abort(self._code, "injected")
        return scoring_pb2.ScoreResponse(rewards=from_numpy(np.ones(len(request.queries), np.float32)))


async def _client_for(servicer, timeout_s=5.0):
    server = grpc.aio.server()
    scoring_pb2_grpc.add_ScoringServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = open_channel(f"127.0.0.1:{port}", 1 << 20)
    return server, channel, ScorerClient(channel, timeout_s, retry_wait_max_s=0.2)


async def _score(client):
    return await client.score(ScoreBatch(("q1", "q2"), ("p", "p"), ("", ""), ("", "")), Deadline())


async def test_unavailable_is_retried_until_the_scorer_answers():
    servicer = FlakyScoring(failures=3, code=grpc.StatusCode.UNAVAILABLE)
    server, channel, client = await _client_for(servicer)
    scores = await _score(client)
    assert scores.rewards.tolist() == [1.0, 1.0] and servicer.calls == 4
    await channel.close()
    await server.stop(0)


async def test_unavailable_past_the_budget_raises_not_ready():
    servicer = FlakyScoring(failures=10**6, code=grpc.StatusCode.UNAVAILABLE)
    server, channel, client = await _client_for(servicer, timeout_s=1.0)
    with pytest.raises(NotReady, match="scorer: UNAVAILABLE"):
        await _score(client)
    assert servicer.calls > 1
    await channel.close()
    await server.stop(0)


async def test_invalid_argument_is_not_retried():
    servicer = FlakyScoring(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    server, channel, client = await _client_for(servicer)
    with pytest.raises(InvalidRequest):
        await _score(client)
    assert servicer.calls == 1
    await channel.close()
    await server.stop(0)

"""The one interceptor maps domain errors to status codes, and anything else to a generic INTERNAL."""

import grpc
import pytest

from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.errors import InvalidRequest, NotReady, Overloaded, UpstreamTimeout
from services.common.server import create_server
from services.scorer.servicer import ScoringServicer
from services.scorer.settings import ScorerSettings

ERRORS = {
    "invalid": (InvalidRequest("queries[3]", "too long"), grpc.StatusCode.INVALID_ARGUMENT, "queries[3]: too long"),
    "not-ready": (NotReady("scorer warming up"), grpc.StatusCode.UNAVAILABLE, "scorer warming up"),
    "overloaded": (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    "timeout": (UpstreamTimeout("remote RM timed out"), grpc.StatusCode.DEADLINE_EXCEEDED, "remote RM timed out"),
    "bug": (ZeroDivisionError("secret internals"), grpc.StatusCode.INTERNAL, "internal error (id "),
}


class RaisingScorer:
    """A scorer core that raises the error named by the first query's label."""

    async def score(self, items, deadline):
        raise ERRORS[items[0].label][0]


@pytest.fixture(scope="module")
async def stub():
    servicer = ScoringServicer(RaisingScorer(), ScorerSettings())
    running = await create_server(
        host="127.0.0.1", port=0, service_names=["fastexp.v1.ScoringService"], max_message_bytes=1 << 20,
        register=lambda server: scoring_pb2_grpc.add_ScoringServiceServicer_to_server(servicer, server),
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield scoring_pb2_grpc.ScoringServiceStub(channel)
    await channel.close()
    await running.stop(0)


@pytest.mark.parametrize("name", list(ERRORS))
async def test_status_mapping(stub, name):
    _, code, message = ERRORS[name]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Score(scoring_pb2.ScoreRequest(queries=["x"], prompts=[""], labels=[name]), timeout=5)
    assert info.value.code() == code
    assert info.value.details().startswith(message)
    assert "secret" not in info.value.details()


async def test_health_watch_streams_through_the_error_mapping():
    """grpc's health Watch writes with context.write() (a coroutine, not a generator): the interceptor that maps
    errors must pass it through, so a client can watch a service go SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    running = await create_server(
        host="127.0.0.1", port=0, service_names=["fastexp.v1.ScoringService"], max_message_bytes=1 << 20,
        register=lambda server: None,
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await running.set_serving(True)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    finally:
        await channel.close()
        await running.stop(0)

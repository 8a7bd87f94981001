"""The observing interceptor: every call counted by its final status code and timed, the caller's x-request-id
bound to the call (and sent on by the call's own outbound calls over a services' channel, whose ClientEdge reads
it); JSON logs carry it."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
from prometheus_client import REGISTRY

from fastexp.channels import REQUEST_ID_KEY
from services.common.channels import open_channel
from services.common.errors import InvalidRequest
from services.common.logs import configure_logging
from services.common.server import create_server

SERVICE = "fastexp.test.Echo"


def _count(method: str, code: str) -> float:
    value = REGISTRY.get_sample_value(
        "fastexp_grpc_server_handled_total", {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code}
    )
    return value or 0.0


async def _received(request: bytes, context) -> bytes:
    """The request id this call arrived with ("" without one)."""
    return dict(context.invocation_metadata()).get(REQUEST_ID_KEY, "").encode()


async def _reject(request: bytes, context) -> bytes:
    raise InvalidRequest("prompts[3]", "is empty")


async def _stream(request: bytes, context):
    for _ in range(3):
        yield b"x"


def _register(server: grpc.aio.Server, relay) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "RequestId": grpc.unary_unary_rpc_method_handler(relay),
        "Received": grpc.unary_unary_rpc_method_handler(_received),
        "Reject": grpc.unary_unary_rpc_method_handler(_reject),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    }),))


@pytest.fixture
async def channel():
    peer: dict[str, grpc.aio.Channel] = {}

    async def relay(request: bytes, context) -> bytes:
        """Call Received as a service calls its peers: over a channel the services open (open_channel)."""
        return await peer["channel"].unary_unary(f"/{SERVICE}/Received")(b"", timeout=5)

    running = await create_server(host="127.0.0.1", port=0, register=lambda server: _register(server, relay),
                                  service_names=[SERVICE], max_message_bytes=1024 * 1024)
    address = f"127.0.0.1:{running.port}"
    async with open_channel(address, 1024 * 1024) as peer["channel"], grpc.aio.insecure_channel(address) as channel:
        yield channel
    await running.stop(0)


async def test_calls_are_counted_by_final_status_code(channel):
    ok, invalid, streamed = _count("RequestId", "OK"), _count("Reject", "INVALID_ARGUMENT"), _count("Stream", "OK")
    await channel.unary_unary(f"/{SERVICE}/RequestId")(b"", timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary(f"/{SERVICE}/Reject")(b"", timeout=5)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [m async for m in channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=5)] == [b"x"] * 3
    assert _count("RequestId", "OK") == ok + 1
    assert _count("Reject", "INVALID_ARGUMENT") == invalid + 1
    assert _count("Stream", "OK") == streamed + 1
    assert REGISTRY.get_sample_value(
        "fastexp_grpc_server_handling_seconds_count", {"grpc_service": SERVICE, "grpc_method": "Stream"}
    ) >= 1


async def test_the_callers_request_id_is_bound_to_the_call_and_sent_on(channel):
    call = channel.unary_unary(f"/{SERVICE}/RequestId")
    assert await call(b"", timeout=5, metadata=(("x-request-id", "trainer-7"),)) == b"trainer-7"
    assert await call(b"", timeout=5) == b""  # none given: none bound, nothing sent


def test_json_logs_are_one_object_per_line_with_the_request_id(capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json")
        logging.getLogger("fastexp.test").info("hello %s", "world")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    record = json.loads(line)
    assert record["message"] == "hello world" and record["level"] == "INFO" and record["request_id"] == "-"

"""The one client edge: the status table read both ways, and the one client interceptor on all four call shapes,
blocking (the trainer's SDK) and asyncio (the services' own clients), against a real server that checks tokens."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import pytest

from fastexp.channels import REQUEST_ID_KEY, ClientEdge, client_channel
from fastexp.errors import (
    EpisodeFailed,
    FailedPrecondition,
    FastexpError,
    InvalidRequest,
    NotReady,
    Overloaded,
    RewardFailed,
    StreamFailed,
    UpstreamTimeout,
)
from fastexp.status import (
    INVALID_PROMPTS_KEY,
    RECEIVED_KINDS,
    STATUS_TABLE,
    RemoteError,
    attributed_error,
    code_of,
    received_error,
)
from services.common.channels import open_channel
from services.common.security import AuthInterceptor
from services.common.server import create_server

TOKEN = "edge-token-7d2e"  # noqa: S105 - test credential
SERVICE = "fastexp.test.Edge"
#: One instance of every domain kind, as a core raises it.
DOMAIN_ERRORS = [
    InvalidRequest("sampling.top_p", "must be in (0, 1]"), NotReady("warming up"), Overloaded("queue full"),
    UpstreamTimeout("scorer did not answer"), FailedPrecondition("engine asleep"), EpisodeFailed("env failed"),
    RewardFailed("rm: 2 of 4 unscored"), StreamFailed(Overloaded("queue full"), [3, 5]),
]
#: method name -> the channel's factory of that shape
SHAPES = {"UnaryUnary": "unary_unary", "UnaryStream": "unary_stream", "StreamUnary": "stream_unary",
          "StreamStream": "stream_stream"}


# --- the table, both ways ------------------------------------------------------------------------------------


@pytest.mark.parametrize("error", DOMAIN_ERRORS, ids=lambda e: type(e).__name__)
def test_every_domain_error_goes_to_its_code_and_comes_back_as_a_kind_with_that_code(error):
    code = code_of(error)
    assert code != grpc.StatusCode.INTERNAL
    received = received_error(code, str(error))
    assert isinstance(received, RemoteError) and isinstance(received, grpc.RpcError)
    assert received.code() == code and received.details() == str(error)
    assert code_of(received) == code  # and back: a service relaying it reports the same code
    kind = RECEIVED_KINDS[code]
    assert isinstance(received, kind)
    own = type(error.cause if isinstance(error, StreamFailed) else error)
    # its own kind, or the kind of an earlier row with the same code (RewardFailed reads back as NotReady)
    assert kind is own or STATUS_TABLE.index((kind, code)) < STATUS_TABLE.index((own, code))
    relayed = attributed_error("generator a:1", received)
    assert type(relayed) is kind and code_of(relayed) == code and not isinstance(relayed, grpc.RpcError)


def test_a_code_read_back_is_the_first_row_of_that_code_and_unknown_codes_are_plain_remote_errors():
    for kind, code in STATUS_TABLE:
        assert code_of(kind.__new__(kind)) == code
        assert RECEIVED_KINDS[code] is next(k for k, c in STATUS_TABLE if c == code)
    assert RECEIVED_KINDS[grpc.StatusCode.CANCELLED] is NotReady  # the peer went away mid-call
    unknown = received_error(grpc.StatusCode.UNAUTHENTICATED, "needs a token")
    assert type(unknown) is RemoteError and isinstance(unknown, FastexpError)
    assert code_of(unknown) == grpc.StatusCode.INTERNAL
    assert type(attributed_error("scorer", unknown)) is FastexpError


def test_a_received_invalid_request_names_its_field_and_prompts_and_survives_pickling():
    received = received_error(grpc.StatusCode.INVALID_ARGUMENT, "prompts[2].images[0]: not an image",
                              ((INVALID_PROMPTS_KEY, "2,4"),))
    assert (received.field, received.reason) == ("prompts[2].images[0]", "not an image")
    assert received.invalid_prompt_indices == [2, 4] and received.undelivered_prompt_indices is None
    again = pickle.loads(pickle.dumps(received))
    assert type(again) is type(received) and again.field == received.field and again.code() == received.code()


# --- the interceptor, against a real server -------------------------------------------------------------------


def _answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """What the server saw: the request id, or the domain error the request names."""
    if request.startswith(b"raise:"):
        raise next(e for e in DOMAIN_ERRORS if type(e).__name__ == request.removeprefix(b"raise:").decode())
    metadata = dict(context.invocation_metadata())
    return f"ok {metadata.get(REQUEST_ID_KEY, '-')}".encode()


async def _unary_unary(request, context):
    return _answer(request, context)


async def _unary_stream(request, context):
    yield _answer(request, context)
    yield b"second"


async def _stream_unary(requests, context):
    return _answer(b"".join([r async for r in requests]), context)


async def _stream_stream(requests, context):
    async for request in requests:
        yield _answer(request, context)


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
    }),))


@pytest.fixture(scope="module")
async def address():
    running = await create_server(host="127.0.0.1", port=0, register=_register, service_names=[SERVICE],
                                  max_message_bytes=1 << 20, auth=AuthInterceptor([TOKEN.encode()], []))
    yield f"127.0.0.1:{running.port}"
    await running.stop(0)


def _sync_call(channel: grpc.Channel, shape: str, request: bytes) -> list[bytes]:
    """One call of ``shape`` on a blocking channel; its responses."""
    method = getattr(channel, SHAPES[shape])(f"/{SERVICE}/{shape}")
    argument = iter([request]) if shape.startswith("Stream") else request
    answer = method(argument, timeout=10)
    return list(answer) if shape.endswith("Stream") else [answer]


async def _aio_call(channel: grpc.aio.Channel, shape: str, request: bytes) -> list[bytes]:
    method = getattr(channel, SHAPES[shape])(f"/{SERVICE}/{shape}")
    argument = iter([request]) if shape.startswith("Stream") else request
    if shape.endswith("Stream"):
        return [response async for response in method(argument, timeout=10)]
    return [await method(argument, timeout=10)]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_the_blocking_edge_sends_the_token_on_every_call_shape_and_raises_domain_kinds(address, shape):
    def calls() -> tuple[list[bytes], grpc.RpcError, grpc.RpcError]:
        with client_channel(address, token=TOKEN) as channel:
            answers = _sync_call(channel, shape, b"hello")
            with pytest.raises(InvalidRequest) as invalid:
                _sync_call(channel, shape, b"raise:InvalidRequest")
        with client_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            _sync_call(channel, shape, b"hello")
        return answers, invalid.value, refused.value

    answers, invalid, refused = await asyncio.to_thread(calls)
    assert answers[0] == b"ok -"
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT and invalid.field == "sampling.top_p"
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED  # the token above was the edge's doing
    assert type(refused) is RemoteError


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_the_asyncio_edge_sends_token_and_request_id_on_every_call_shape(address, shape):
    edge = ClientEdge(TOKEN, request_id=lambda: "req-42")
    async with grpc.aio.insecure_channel(address, interceptors=edge.for_aio()) as channel:
        assert (await _aio_call(channel, shape, b"hello"))[0] == b"ok req-42"
        with pytest.raises(Overloaded) as overloaded:
            await _aio_call(channel, shape, b"raise:StreamFailed")  # a StreamFailed has its cause's code
        assert overloaded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert isinstance(overloaded.value, grpc.aio.AioRpcError)  # `except AioRpcError` sites keep working
    async with grpc.aio.insecure_channel(address, interceptors=ClientEdge().for_aio()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _aio_call(channel, shape, b"hello")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("error", DOMAIN_ERRORS, ids=lambda e: type(e).__name__)
async def test_every_domain_error_raised_by_a_server_reaches_the_services_clients_as_its_kind(address, error):
    channel = open_channel(address, 1 << 20, token=TOKEN)  # the services' own outbound channel
    try:
        with pytest.raises(RemoteError) as raised:
            await _aio_call(channel, "UnaryStream", f"raise:{type(error).__name__}".encode())
    finally:
        await channel.close()
    assert raised.value.code() == code_of(error)
    assert isinstance(raised.value, RECEIVED_KINDS[code_of(error)])

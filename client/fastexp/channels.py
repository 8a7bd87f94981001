"""The client edge of every fastexp channel (the SDK's, and the services' calls to each other): channel options,
and :class:`ClientEdge`, the one client interceptor (credentials and request id out, domain errors back)."""

from __future__ import annotations

import collections
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from fastexp.security import ClientTLS, bearer_metadata
from fastexp.status import from_rpc_error

#: The metadata key carrying a request id across services (their logs name it).
REQUEST_ID_KEY = "x-request-id"

#: Client channels try to reconnect to a peer that is gone at most this often. gRPC's own default grows to 120 s,
#: so a dependency that comes up after a long wait (an engine loading on a cold machine) or is restarted would
#: stay unused for up to two minutes after it turned SERVING: calls fail fast while the channel backs off.
RECONNECT_BACKOFF_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """A client channel's HTTP/2 keepalive: a ping every ``interval_s`` seconds while calls are open (also while
    the peer sends nothing: a stream waiting for its next batch), the connection dropped when an answer takes over
    ``max(1, interval_s / 2)`` seconds. A peer that vanished without closing it (a node lost, a silent network
    partition) then fails the calls with UNAVAILABLE within ~1.5 intervals, instead of at their deadline; a
    resumable stream is resumed. Servers accept such pings down to 1 s apart (:data:`SERVER_KEEPALIVE_OPTIONS`)."""
    timeout_ms = int(max(1.0, interval_s / 2) * 1000)
    return [
        ("grpc.keepalive_time_ms", int(interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),  # gRPC's own ping timeout (60 s) would otherwise apply
        ("grpc.http2.max_pings_without_data", 0),  # the peer may send nothing for minutes: keep pinging
    ]


#: Every fastexp server's keepalive: it accepts its clients' pings (:func:`keepalive_options`) one a second at most
#: while calls are open (gRPC's default, one per 5 minutes without data, would answer GOAWAY "too_many_pings"), and
#: pings its clients every 30 s itself, dropping a connection whose ping is unanswered for 10 s: the calls of a
#: client that vanished (a trainer whose network was cut: it resumed its stream elsewhere) end within ~40 s, their
#: generation stopped and their run slots given back, instead of running on to their deadline.
SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The largest message both ways (servers and clients)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """A client channel's options: :func:`message_options` and the reconnect backoff above."""
    return [*message_options(max_message_bytes), *RECONNECT_BACKOFF_OPTIONS]


class ClientEdge(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor,
    grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor,
):
    """The one client interceptor of every fastexp channel, all four call shapes, blocking and asyncio alike.

    On the way out it adds ``authorization: Bearer <token>`` (when ``token``) and ``x-request-id`` (when
    ``request_id()`` returns one and the call does not carry one already). On the way back a failed call is
    raised as its domain kind by the status table (:func:`fastexp.status.received_error`): an instance of, say,
    :class:`fastexp.errors.InvalidRequest` that is also a ``grpc.aio.AioRpcError`` with the call's code, details
    and trailing metadata. Errors of the call's own making (a request that cannot be serialised) pass untouched.

    Blocking channels take it as is (:func:`client_channel`, ``grpc.intercept_channel``); asyncio channels take
    :meth:`for_aio`. The two APIs call the same method names, told apart by the call details' type.
    """

    def __init__(self, token: str | None = None, request_id: Callable[[], str | None] | None = None) -> None:
        self._token_metadata = bearer_metadata(token)
        self._request_id = request_id

    def for_aio(self) -> list[grpc.aio.ClientInterceptor]:
        """This edge as ``grpc.aio`` channels' ``interceptors``: grpc.aio files an interceptor under the first call
        kind it implements only (grpc/grpc#34537, #40946), so the edge is given once per kind through a view
        implementing that kind alone."""
        return [_aio_view(kind)(self) for kind in _AIO_KINDS]

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details = self._outbound(client_call_details)
        if isinstance(details, grpc.aio.ClientCallDetails):
            return _aio_unary(continuation(details, request))
        return _sync_unary(continuation(details, request))

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        details = self._outbound(client_call_details)
        if isinstance(details, grpc.aio.ClientCallDetails):
            return _aio_unary(continuation(details, request_iterator))
        return _sync_unary(continuation(details, request_iterator))

    def intercept_unary_stream(self, continuation, client_call_details, request):
        details = self._outbound(client_call_details)
        if isinstance(details, grpc.aio.ClientCallDetails):
            return _aio_stream(continuation(details, request))
        return _MappedStream(continuation(details, request))

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        details = self._outbound(client_call_details)
        if isinstance(details, grpc.aio.ClientCallDetails):
            return _aio_stream(continuation(details, request_iterator))
        return _MappedStream(continuation(details, request_iterator))

    def _outbound(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        """``details`` with the edge's metadata added."""
        metadata = list(details.metadata or ())
        added = list(self._token_metadata)
        request_id = self._request_id() if self._request_id else None
        if request_id and all(key != REQUEST_ID_KEY for key, _ in metadata):
            added.append((REQUEST_ID_KEY, request_id))
        if not added:
            return details
        if isinstance(details, grpc.aio.ClientCallDetails):
            return details._replace(metadata=grpc.aio.Metadata(*metadata, *added))
        return _CallDetails(details.method, details.timeout, (*metadata, *added), details.credentials,
                            details.wait_for_ready, getattr(details, "compression", None))


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    """A blocking call's details (grpc's own record is private)."""


def _is_call_failure(error: BaseException | None) -> bool:
    """A failure the peer answered (or the transport reported), not an error raised before the call."""
    return isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call)


def _sync_unary(outcome: Any) -> Any:
    error = outcome.exception()
    if _is_call_failure(error):
        raise from_rpc_error(error) from None
    return outcome


class _MappedStream:
    """A blocking response stream whose failure is raised as its domain kind; anything else is the call's
    (``cancel()``, ``trailing_metadata()``, ...)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> _MappedStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as error:
            if not _is_call_failure(error):
                raise
            raise from_rpc_error(error) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def _aio_unary(pending: Awaitable[grpc.aio.Call]) -> grpc.aio.Call:
    call = await pending
    try:
        await call  # a finished call answers again at once: the caller's await gets the same response
    except grpc.aio.AioRpcError as error:
        raise from_rpc_error(error) from None
    return call


async def _aio_stream(pending: Awaitable[grpc.aio.Call]) -> AsyncIterator[Any]:
    call = await pending

    async def responses() -> AsyncIterator[Any]:
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error) from None

    return responses()


_AIO_KINDS = (
    grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor,
)


@functools.cache
def _aio_view(kind: type) -> type:
    """A class implementing ``kind`` alone by handing the call to its edge (see :meth:`ClientEdge.for_aio`)."""
    (method,) = kind.__abstractmethods__

    def __init__(self, edge: ClientEdge) -> None:  # noqa: N807 - a method of the class made below
        self.edge = edge

    def intercept(self, continuation, client_call_details, request):
        return getattr(self.edge, method)(continuation, client_call_details, request)

    return type(f"ClientEdge{kind.__name__.removesuffix('ClientInterceptor')}", (kind,),
                {"__init__": __init__, method: intercept, "__module__": __name__})


def client_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), tls: ClientTLS | None = None, token: str | None = None,
) -> grpc.Channel:
    """A blocking channel to ``address`` through a :class:`ClientEdge`, with :data:`RECONNECT_BACKOFF_OPTIONS`
    added to ``options``; TLS when ``tls``, ``authorization: Bearer`` on every call when ``token``.

    Raises:
        fastexp.security.SecurityConfigError: a TLS file is missing or empty.
    """
    options = [*options, *RECONNECT_BACKOFF_OPTIONS]  # a service that comes up late is used within 2 s
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])
    return grpc.intercept_channel(channel, ClientEdge(token))

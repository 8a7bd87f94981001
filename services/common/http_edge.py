"""How every HTTP edge is served (the sandbox server, the reference reward server, the experience service's
OpenAI-compatible gateway): one uvicorn configuration, so none of them runs on uvicorn's defaults.

uvicorn's default HTTP implementation (httptools) bounds neither a request's headers nor a chunked body's
trailers, and it holds every connection it accepts: a caller without a token could make the server buffer hundreds
of MiB before any check runs, in one connection or in thousands of slow ones. The edges run on
:class:`EdgeProtocol`, uvicorn's h11 protocol with three bounds, the way nginx bounds headers
(``large_client_header_buffers``, 4 × 8 KiB), their time (``client_header_timeout``) and connections
(``worker_connections``):

- a request line + headers, or a chunked body's trailers, past :data:`MAX_HEAD_BYTES` are refused as soon as they
  pass it (400, connection closed);
- a request head must arrive whole within :data:`HEAD_TIMEOUT_S` of the connection's opening, or of the previous
  response on a kept-alive connection (the rest of a body the app answered without reading included), or the
  connection is closed;
- at most ``max_connections`` (:data:`MAX_CONNECTIONS` by default) connections are held; one past it, or one
  opening while as many requests are still running (a caller may close its connection while its request runs), is
  answered 503 at once, unread, and closed (after up to :data:`TURN_AWAY_LINGER_S` discarding what it sends, so
  that its caller reads the 503 rather than a reset; with ``max_connections`` of them lingering, at once).
  Requests on held connections are all served, so up to about twice ``max_connections`` requests may run.

With TLS the edge does the handshake itself (:class:`EdgeTLS`, asyncio's own TLS protocol) rather than the event
loop's server, which would allocate each connection's 256 KiB of TLS buffers, and wait up to 60 s for its handshake,
before the edge sees it: at most ``max_connections`` TLS connections are open, handshaking ones included (one past
it is closed at once), and a handshake has ``head_timeout_s`` too.

So an edge holds at most ``max_connections`` × :data:`MAX_HEAD_BYTES` of unfinished heads (64 MiB by default), and
with TLS ``max_connections`` × 256 KiB of TLS buffers besides.
The body is bounded by :class:`services.common.http_limits.BoundedBody`, after the token check.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
from asyncio import sslproto
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import uvicorn
from starlette.types import ASGIApp
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context
from uvicorn.protocols.http.h11_impl import H11Protocol

if TYPE_CHECKING:  # the gateway's serving stays free of grpc (services.common.security loads it)
    from services.common.settings import ServiceSettings

#: Most bytes of a request line + headers, and of a chunked body's trailers, an HTTP edge buffers (64 KiB).
MAX_HEAD_BYTES = 64 * 1024
#: Default most connections an HTTP edge holds (and requests it runs) at once; past it callers are answered 503.
MAX_CONNECTIONS = 1024
#: Default seconds a request head (request line + headers) has to arrive whole (nginx's ``client_header_timeout``
#: is 60 s).
HEAD_TIMEOUT_S = 30.0
#: Most seconds a TLS connection's closing handshake may take (asyncio's default is 30 s: a client that never
#: answers it would hold its slot that long after the head's deadline closed it).
TLS_SHUTDOWN_TIMEOUT_S = 2.0
#: Most seconds a connection turned away past ``max_connections`` is read (and discarded) after its 503.
TURN_AWAY_LINGER_S = 1.0
_TURN_AWAY_BODY = b"Too many connections; retry later."
_TURN_AWAY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TURN_AWAY_BODY), _TURN_AWAY_BODY))


class Count:
    """A count shared by the connections of one edge (its protocol factory's)."""

    def __init__(self) -> None:
        self.value = 0


class EdgeProtocol(H11Protocol):
    """uvicorn's h11 protocol with a bound on the connections held and a deadline on each request head (module
    docs). ``max_connections``: connections held at most (one opening while as many requests still run is turned
    away too); ``head_timeout_s``: seconds a head has to arrive whole; ``turning_away``: the edge's connections
    being turned away (past ``max_connections`` of them one is closed at once, without its 503)."""

    def __init__(self, *args, max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S,
                 turning_away: Count | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections, self.head_timeout_s = max_connections, head_timeout_s
        self.turning_away = turning_away if turning_away is not None else Count()
        self.head_deadline: asyncio.TimerHandle | None = None
        self.turned_away = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections:
            self._turn_away()
        else:
            self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.turned_away:
            return  # read and dropped, so that closing does not reset the connection before the 503 is read
        super().data_received(data)
        if self._serving():
            self._cancel_head_deadline()
        elif self.head_deadline is None and not self.transport.is_closing():
            self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._serving():
            # the next head on a kept-alive connection has the same time, and so has the rest of a body the
            # request was answered without (the app answered first: nothing else bounds it then)
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        if self.turned_away:
            self.turning_away.value -= 1
        super().connection_lost(exc)

    def _serving(self) -> bool:
        """Whether a request's head came in and its response is not complete (the app bounds its body)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_timed_out(self) -> None:
        self.head_deadline = None
        if not self._serving() and not self.transport.is_closing():
            self.logger.info("A request head did not arrive within %.0f s; connection closed.", self.head_timeout_s)
            self.transport.close()

    def _turn_away(self) -> None:
        self.turned_away = True
        self.turning_away.value += 1
        self.connections.discard(self)  # not held: it does not count toward the bound
        if self.turning_away.value > self.max_connections or not self.transport.can_write_eof():
            self.transport.close()  # a flood of them, or TLS (no half-close): no lingering
            return
        self.transport.write(_TURN_AWAY)
        self.transport.write_eof()
        self.loop.call_later(TURN_AWAY_LINGER_S, self.transport.close)


class EdgeTLS(sslproto.SSLProtocol):
    """TLS over one :class:`EdgeProtocol` connection, made by the edge's protocol factory (module docs): counted in
    ``connections`` from the connection's acceptance to its loss, its handshake bounded by ``handshake_timeout_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, edge: EdgeProtocol, context: ssl.SSLContext,
                 handshake_timeout_s: float, connections: Count) -> None:
        super().__init__(loop, edge, context, None, server_side=True, ssl_handshake_timeout=handshake_timeout_s,
                         ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT_S)
        self._connections = connections
        connections.value += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.value -= 1
        super().connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A TLS connection past the bound: closed at once, nothing allocated for it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        transport.close()


def _protocols(max_connections: int, head_timeout_s: float, tls: ssl.SSLContext | None):
    """The protocol factory uvicorn calls per accepted connection (its ``http`` class's signature)."""
    tls_connections, turning_away = Count(), Count()  # open TLS connections (handshaking ones too); turned away

    def create(config: uvicorn.Config, server_state, app_state: dict, _loop: asyncio.AbstractEventLoop | None = None):
        if tls is not None and tls_connections.value >= max_connections:
            return _Refused()
        edge = EdgeProtocol(config, server_state, app_state, _loop, max_connections=max_connections,
                            head_timeout_s=head_timeout_s, turning_away=turning_away)
        if tls is None:
            return edge
        return EdgeTLS(_loop or asyncio.get_running_loop(), edge, tls, head_timeout_s, tls_connections)

    return create


def edge_config(app: ASGIApp, host: str, port: int, *, grace_s: float, log_level: str = "warning",
                cert_file: Path | None = None, key_file: Path | None = None, client_ca_file: Path | None = None,
                max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S,
                lifespan: Literal["auto", "on", "off"] = "auto") -> uvicorn.Config:
    """The uvicorn configuration of an HTTP edge serving ``app`` on ``host:port`` (module docs): h11, headers and
    trailers bounded by :data:`MAX_HEAD_BYTES` bytes and each head by ``head_timeout_s`` seconds, at most
    ``max_connections`` connections (and requests) at once, ``grace_s`` seconds (at least 1) for calls in flight at
    shutdown, TLS when ``cert_file`` (and ``key_file``, PEM) are given, mutual TLS with ``client_ca_file`` as well
    (a client without a certificate that CA signed fails the handshake, before any byte of a request is read: as
    the gRPC port of a service with ``tls_client_ca_file``).

    Raises:
        ValueError: ``max_connections`` is below 1, ``head_timeout_s`` is not positive, or ``client_ca_file`` is
            given without ``cert_file``.
    """
    if max_connections < 1:
        raise ValueError(f"max_connections: at least 1, not {max_connections}")
    if head_timeout_s <= 0:
        raise ValueError(f"head_timeout_s: above 0, not {head_timeout_s}")
    if client_ca_file is not None and cert_file is None:
        raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
    tls = None
    if cert_file is not None:  # uvicorn's own context (its defaults), used by the edge's protocols (module docs)
        required = ssl.CERT_NONE if client_ca_file is None else ssl.CERT_REQUIRED
        tls = create_ssl_context(cert_file, key_file, None, SSL_PROTOCOL_VERSION, required,
                                 None if client_ca_file is None else str(client_ca_file), None)
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), lifespan=lifespan,
        timeout_graceful_shutdown=max(1, int(grace_s)), http=_protocols(max_connections, head_timeout_s, tls),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )


def service_edge_config(app: ASGIApp, settings: ServiceSettings,
                        max_connections: int = MAX_CONNECTIONS) -> uvicorn.Config:
    """:func:`edge_config` for a service of its own: ``settings``' host, port, log level, grace period and TLS
    (mutual with ``tls_client_ca_file``).

    Raises:
        ValueError: ``max_connections`` is below 1.
    """
    return edge_config(app, settings.host, settings.port, grace_s=settings.grace_period_s,
                       log_level=settings.log_level, cert_file=settings.tls_cert_file,
                       key_file=settings.tls_key_file, client_ca_file=settings.tls_client_ca_file,
                       max_connections=max_connections)


async def run_edge(config: uvicorn.Config) -> None:
    """Serve ``config`` until SIGTERM/SIGINT, then return once uvicorn has drained (the process exits 0, as the
    gRPC services do, instead of uvicorn re-raising the signal)."""
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # uvicorn drains, then re-raises: make that a no-op
        signal.signal(stop_signal, lambda *_: None)
    with contextlib.suppress(asyncio.CancelledError):
        await uvicorn.Server(config).serve()

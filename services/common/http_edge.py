"""How every HTTP edge is served (the sandbox server, the reference reward server, the experience service's
OpenAI-compatible gateway): one uvicorn configuration, so none of them runs on uvicorn's defaults.

uvicorn's default HTTP implementation (httptools) bounds neither a request's headers nor a chunked body's
trailers: a caller without a token could make the server buffer hundreds of MiB before any check runs. The edges
run on h11 instead, which refuses a request whose request line + headers, or whose trailers, pass
:data:`MAX_HEAD_BYTES` (400, connection closed) as soon as they do; and with a bound on concurrent connections and
requests (:data:`MAX_CONNECTIONS` by default: past it a request is answered 503), the way nginx bounds headers
(``large_client_header_buffers``, 4 × 8 KiB) and connections (``worker_connections``). The body is bounded by
:class:`services.common.http_limits.BoundedBody`, after the token check.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:  # the gateway's serving stays free of grpc (services.common.security loads it)
    from services.common.settings import ServiceSettings

#: Most bytes of a request line + headers, and of a chunked body's trailers, an HTTP edge buffers (64 KiB).
MAX_HEAD_BYTES = 64 * 1024
#: Default most connections + requests an HTTP edge holds at once; past it requests are answered 503.
MAX_CONNECTIONS = 1024


def edge_config(app: ASGIApp, host: str, port: int, *, grace_s: float, log_level: str = "warning",
                cert_file: Path | None = None, key_file: Path | None = None,
                max_connections: int = MAX_CONNECTIONS,
                lifespan: Literal["auto", "on", "off"] = "auto") -> uvicorn.Config:
    """The uvicorn configuration of an HTTP edge serving ``app`` on ``host:port`` (module docs): h11, headers and
    trailers bounded by :data:`MAX_HEAD_BYTES` bytes, at most ``max_connections`` connections + requests at once,
    ``grace_s`` seconds (at least 1) for calls in flight at shutdown, TLS when ``cert_file`` and ``key_file``
    (PEM) are given.

    Raises:
        ValueError: ``max_connections`` is below 1.
    """
    if max_connections < 1:
        raise ValueError(f"max_connections: at least 1, not {max_connections}")
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), lifespan=lifespan,
        timeout_graceful_shutdown=max(1, int(grace_s)), ssl_certfile=cert_file, ssl_keyfile=key_file,
        http="h11", h11_max_incomplete_event_size=MAX_HEAD_BYTES, limit_concurrency=max_connections,
    )


def service_edge_config(app: ASGIApp, settings: ServiceSettings,
                        max_connections: int = MAX_CONNECTIONS) -> uvicorn.Config:
    """:func:`edge_config` for a service of its own: ``settings``' host, port, log level, grace period and TLS.

    Raises:
        ValueError: ``max_connections`` is below 1.
    """
    return edge_config(app, settings.host, settings.port, grace_s=settings.grace_period_s,
                       log_level=settings.log_level, cert_file=settings.tls_cert_file,
                       key_file=settings.tls_key_file, max_connections=max_connections)


async def run_edge(config: uvicorn.Config) -> None:
    """Serve ``config`` until SIGTERM/SIGINT, then return once uvicorn has drained (the process exits 0, as the
    gRPC services do, instead of uvicorn re-raising the signal)."""
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # uvicorn drains, then re-raises: make that a no-op
        signal.signal(stop_signal, lambda *_: None)
    with contextlib.suppress(asyncio.CancelledError):
        await uvicorn.Server(config).serve()

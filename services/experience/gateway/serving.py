"""Serving the gateway's app with uvicorn inside the experience service's event loop, on a port of its own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from services.common.http_edge import MAX_CONNECTIONS, edge_config


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the experience service owns SIGTERM and stops the gateway itself."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass
class RunningGateway:
    """The bound port and the task serving it."""

    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        """Stop accepting, let calls in flight end (uvicorn's graceful shutdown), then return."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def start_gateway(app: FastAPI, host: str, port: int, grace_s: float, cert_file: Path | None = None,
                  key_file: Path | None = None, max_connections: int = MAX_CONNECTIONS,
                  client_ca_file: Path | None = None) -> RunningGateway:
    """Bind ``host:port`` (0: any free port) now and serve ``app`` there in a task of the running loop, on the HTTP
    edges' uvicorn configuration (:func:`services.common.http_edge.edge_config`: headers bounded, at most
    ``max_connections`` connections + requests at once, ``grace_s`` seconds for calls in flight at shutdown; TLS
    with ``cert_file``/``key_file``, mutual with ``client_ca_file``).

    The socket listens before this returns, so a client may connect at once (its connection waits in the backlog
    until uvicorn accepts it).

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``max_connections`` is below 1.
    """
    config = edge_config(app, host, port, grace_s=grace_s, cert_file=cert_file, key_file=key_file,
                         client_ca_file=client_ca_file, max_connections=max_connections, lifespan="off")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="gateway")
    return RunningGateway(sock.getsockname()[1], server, task)

"""Serve an ASGI app with uvicorn on a free loopback port in a background thread (its own event loop)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serving(app, timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``app`` until the block ends; yields its base URL, ``http://127.0.0.1:<port>``.

    Raises:
        RuntimeError: the server did not start within ``timeout_s`` (e.g. its lifespan startup failed).
    """
    with serving_config(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), timeout_s) as port:
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving_config(config: uvicorn.Config, timeout_s: float = 60.0) -> Iterator[int]:
    """Serve ``config`` (e.g. a service's own, as production builds it) until the block ends; yields the bound port.

    Raises:
        RuntimeError: the server did not start within ``timeout_s``.
    """
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:  # the event: uvicorn's own flag, polled
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)

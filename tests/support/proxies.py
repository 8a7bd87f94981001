"""Real proxies for tests that are not async (the chaos suite drives real processes from a plain test): each runs
on an event loop of its own thread.

- :class:`TcpProxy`: one loopback address in front of several backends, as a Kubernetes Service is: each new
  connection goes to the first backend that accepts it; :meth:`TcpProxy.cut` aborts every open connection (a
  network cut: both ends see their connection reset), :meth:`TcpProxy.black_hole` keeps them open but drops every
  byte from then on (a silent partition: neither end is told); new connections are accepted as before.
- :class:`GateThread`: a gated gRPC proxy (:func:`tests.support.gates.gated`) of a generator or scorer, its gate
  driven from the test's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tests.support.gates import gated

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread; :meth:`run` runs a coroutine on it and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-proxy-loop")
        self._thread.start()

    def run(self, coroutine: Awaitable[T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class TcpProxy:
    """A TCP proxy on a loopback port in front of ``backends`` (``host:port``, in order of preference)."""

    def __init__(self, backends: Sequence[str]) -> None:
        self._backends = list(backends)
        self._loop = LoopThread()
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._holes: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()  # pairs whose bytes are dropped
        self.routed: list[str] = []  # the backend of each connection, in order
        self._server = self._loop.run(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for backend in self._backends:
            host, port = backend.rsplit(":", 1)
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
            except OSError:
                continue
            self.routed.append(backend)
            pair = (writer, upstream_writer)
            self._pairs.add(pair)
            try:
                dropped = lambda pair=pair: pair in self._holes  # noqa: E731
                await asyncio.gather(_pipe(reader, upstream_writer, dropped), _pipe(upstream_reader, writer, dropped))
            finally:
                self._pairs.discard(pair)
                for end in pair:
                    end.close()
            return
        writer.transport.abort()  # no backend accepts: refused, as a Service without endpoints

    def black_hole(self) -> int:
        """Drop every byte of the open connections from now on, closing nothing; returns how many there are."""

        async def hole() -> int:
            self._holes.update(self._pairs)
            return len(self._pairs)

        return self._loop.run(hole())

    def cut(self) -> int:
        """Abort every open connection (both ends get a reset); returns how many were cut."""

        async def cut() -> int:
            pairs = list(self._pairs)
            for pair in pairs:
                for end in pair:
                    end.transport.abort()
            return len(pairs)

        return self._loop.run(cut())

    def close(self) -> None:
        """Stop accepting, cut every connection and end their tasks, then stop the loop."""

        async def close() -> None:
            self._server.close()
            for pair in list(self._pairs):
                for end in pair:
                    end.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._loop.run(close())
        self._loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dropped: Callable[[], bool]) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            if not dropped():
                writer.write(data)
                await writer.drain()
    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
        writer.write_eof()


class GateThread:
    """A gated proxy (``kind``: ``generator`` or ``scorer``) of the service at ``upstream_address``: ``address``,
    and its gate driven from any thread."""

    def __init__(self, kind: str, upstream_address: str) -> None:
        self._loop = LoopThread()
        self._proxy = gated(kind, upstream_address)
        self.address, self.gate = self._loop.run(self._proxy.__aenter__())

    def call(self, action: Callable[[], T]) -> T:
        """Run ``action`` on the gate's loop (the gate is not thread-safe)."""

        async def call() -> T:
            return action()

        return self._loop.run(call())

    def close_after(self, passing: int) -> None:
        """Let ``passing`` more calls through, then hold the others."""
        self.call(lambda: self.gate.close(after=passing))

    def open(self) -> None:
        self.call(self.gate.open)

    def wait_held(self, count: int, timeout_s: float = 120.0) -> None:
        """Return once ``count`` calls wait at the gate."""
        self._loop.run(self.gate.wait_held(count, timeout_s), timeout_s + 5)

    def close(self) -> None:
        self._loop.run(self._proxy.__aexit__(None, None, None))
        self._loop.close()

"""Server bootstrap shared by the three services: create, serve, and stop in order.

``create_server`` builds a ``grpc.aio`` server with the observing (metrics, request ids) and error-mapping
interceptors, gRPC health checking and server reflection, bound to ``host:port`` (port 0 picks a free port, as tests do). ``serve_until_signalled``
runs it until SIGTERM/SIGINT, then: health NOT_SERVING -> ``server.stop(grace)`` -> the service's own cleanup. A
stop that has not finished ``STOP_MARGIN_S`` after its grace period logs where every task and thread is and exits
with status 1 (a call or a cleanup that does not end must not keep a stopped replica's process, and its port,
forever; an orchestrator would kill it without saying where it hung). ``kill -USR1`` logs the same while serving.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fastexp.channels import SERVER_KEEPALIVE_OPTIONS, message_options
from services.common.observing import ObservingInterceptor
from services.common.security import AuthInterceptor, ServerTLS, check_exposure
from services.common.stacks import log_on_signal, task_stacks, thread_stacks
from services.common.status import ErrorMappingInterceptor

logger = logging.getLogger(__name__)


#: Health service name that reports SERVING from the moment the server runs until it stops, whatever its
#: dependencies: what liveness and startup probes check, so that a late or restarting dependency takes a pod out
#: of its Service (readiness, the overall "" status) but never gets it restarted.
LIVENESS_SERVICE = "liveness"


class ServingGate:
    """Readiness over several conditions: health SERVING only while every one of ``conditions`` holds (e.g. the
    upstream dependencies reached, and the state store answering). Each condition starts false except those in
    ``initially``; :meth:`setter` gives the callback that reports one of them."""

    def __init__(self, running: RunningServer, conditions: tuple[str, ...], initially: tuple[str, ...] = ()) -> None:
        self._running = running
        self._holds = {name: name in initially for name in conditions}

    def setter(self, condition: str) -> Callable[[bool], Awaitable[None]]:
        """``await setter(condition)(holds)`` reports ``condition`` and updates health."""

        async def report(holds: bool) -> None:
            self._holds[condition] = holds
            await self._running.set_serving(all(self._holds.values()))

        return report


@dataclass
class RunningServer:
    """A started server, its bound port and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    #: told ``grace_s`` when the server stops, before in-flight calls are given that long (a service that hands
    #: its long calls over before the grace ends: the experience service's streams)
    on_stop: Callable[[float], None] | None = None

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the overall server ("") and each service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING (liveness too), then let in-flight calls finish for up to ``grace_s`` seconds."""
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.on_stop is not None:
            self.on_stop(grace_s)
        await self.server.stop(grace_s)




async def create_server(
    *,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    max_message_bytes: int,
    tls: ServerTLS | None = None,
    auth: AuthInterceptor | None = None,
) -> RunningServer:
    """Build, bind and start a server; health reports NOT_SERVING until :meth:`RunningServer.set_serving`, and
    :data:`LIVENESS_SERVICE` SERVING at once.

    Args:
        register: adds the service's servicers to the server.
        service_names: full names (``fastexp.v1.GenerationService``) for health and reflection.
        tls: serve TLS (mTLS with a client CA) instead of plaintext.
        auth: check bearer tokens (health and reflection stay open).

    Raises:
        RuntimeError: the address could not be bound.
        services.common.security.SecurityConfigError: a TLS file is missing or empty.
    """
    interceptors = [ObservingInterceptor(), *([auth] if auth else []), ErrorMappingInterceptor()]
    server = grpc.aio.server(interceptors=interceptors,
                             options=[*message_options(max_message_bytes), *SERVER_KEEPALIVE_OPTIONS])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    await server.start()
    running = RunningServer(server, bound, health_servicer, tuple(service_names))
    await running.set_serving(False)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return running


class ServerSettings(Protocol):
    """The settings fields a server is built from (every service's settings class has them)."""

    host: str
    port: int
    max_message_bytes: int
    insecure: bool

    def secured(self) -> bool: ...

    def server_tls(self) -> ServerTLS | None: ...

    def auth(self) -> AuthInterceptor | None: ...


async def start_service(
    settings: ServerSettings, service_name: str | Sequence[str], register: Callable[[grpc.aio.Server], None]
) -> RunningServer:
    """:func:`create_server` for one fastexp service (or several sharing a process: the scorer serves scoring
    and environments) from its settings (address, message limit, TLS, tokens); health is NOT_SERVING until the
    caller's :meth:`RunningServer.set_serving`.

    Raises:
        RuntimeError: the address could not be bound. SecurityConfigError: a TLS or token file is unusable, or a
            non-loopback host with neither TLS nor tokens and no ``insecure: true`` (:func:`check_exposure`).
    """
    names = [service_name] if isinstance(service_name, str) else list(service_name)
    check_exposure(settings.host, secured=settings.secured(), insecure=settings.insecure, service=names[0])
    return await create_server(
        host=settings.host,
        port=settings.port,
        register=register,
        service_names=names,
        max_message_bytes=settings.max_message_bytes,
        tls=settings.server_tls(),
        auth=settings.auth(),
    )


class Closeable(Protocol):
    async def close(self) -> None: ...


R = TypeVar("R", bound=Closeable)

#: Starts a service: its running server, and what to close once that server has stopped.
Starter = Callable[[], Awaitable[tuple[RunningServer, Callable[[], Awaitable[None]]]]]


def serving(build: Callable[[], R], start: Callable[[R], Awaitable[RunningServer]]) -> Starter:
    """A :data:`Starter` from a resource's builder (an engine, reward sources) and the server start over it; the
    resource's ``close()`` runs once the server has stopped."""

    async def starter() -> tuple[RunningServer, Callable[[], Awaitable[None]]]:
        resource = build()
        return await start(resource), resource.close

    return starter


def run_service(start: Starter, grace_s: float, stop_margin_s: float | None = None) -> None:
    """Start a service and serve it until SIGTERM/SIGINT, then stop in order (blocking; the CLI's entry).
    ``stop_margin_s``: how long the stop may take beyond ``grace_s`` (default :data:`STOP_MARGIN_S`)."""

    async def main() -> None:
        # the handlers go in before anything starts: a start may print its port (or a line a supervisor waits for)
        # before it returns, and a signal before them would take the default action (USR1 and TERM: death)
        signals = _SignalStop()
        running, cleanup = await start()
        signals.started = True
        await serve_until_signalled(running, grace_s, cleanup=cleanup, stop_margin_s=stop_margin_s,
                                    stop=signals.event)

    asyncio.run(main())


class _SignalStop:
    """SIGTERM/SIGINT on the running loop: before the service has started (``started``) they end the process at
    once, status 0 (nothing is served yet, and a start may block the loop for minutes, as an engine's does); after,
    they set ``event``. SIGUSR1 logs every task's and thread's stack."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.started = False
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)  # Python runs it between bytecodes, the loop blocked or not
        log_on_signal(self._loop)

    def _on_signal(self, signum: int, frame: object) -> None:
        # call_soon_threadsafe wakes the loop through its self-pipe, even while it waits in select
        if not self.started:
            try:  # the log's own write may be what this interrupted: the exit comes regardless
                logger.info("stopped while starting (signal %d): nothing served yet", signum)
            finally:
                _flush_and_exit(0)
        if not self._loop.is_closed():  # (a signal after the service has ended: nothing left to stop)
            self._loop.call_soon_threadsafe(self.event.set)


async def serve_until_signalled(
    running: RunningServer, grace_s: float, cleanup: Callable[[], Awaitable[None]] | None = None,
    stop_margin_s: float | None = None, stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (``stop``, which :func:`run_service` has those signals set, its handlers in
    before the service starts) or termination, then stop in order (see module docs; the process's entry only: a
    stop that overruns ``grace_s`` by ``stop_margin_s`` (default :data:`STOP_MARGIN_S`) exits the process)."""
    if stop is None:
        signals = _SignalStop()
        signals.started = True
        stop = signals.event
    waiter = asyncio.create_task(running.server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    logger.info("stopping: draining in-flight calls for up to %.1f s", grace_s)
    margin_s = STOP_MARGIN_S if stop_margin_s is None else stop_margin_s
    limit_s = grace_s + margin_s
    # the event loop itself may be what is stuck: a thread ends the process a little later still
    backstop = threading.Timer(limit_s + BACKSTOP_S, _exit_stuck, (limit_s + BACKSTOP_S,))
    backstop.daemon = True
    backstop.start()
    stopping = asyncio.create_task(_stop(running, grace_s, cleanup), name="stopping")
    done, _ = await asyncio.wait({stopping}, timeout=limit_s)
    if not done:
        logger.error("stopping did not finish within %.1f s (grace period %.1f s + %.1f s): exiting with status 1; "
                     "where it is stuck:\n%s\n%s", limit_s, grace_s, margin_s, task_stacks(), thread_stacks())
        _flush_and_exit(1)
    backstop.cancel()
    waiter.cancel()
    stopper.cancel()
    stopping.result()
    logger.info("stopped")


#: seconds a stop may take beyond its grace period (the service's cleanup: closing channels, leaving the state
#: store, each within its own deadline) before the process exits anyway
STOP_MARGIN_S = 60.0
BACKSTOP_S = 10.0  # then the thread's limit, should the event loop be blocked


async def _stop(running: RunningServer, grace_s: float, cleanup: Callable[[], Awaitable[None]] | None) -> None:
    await running.stop(grace_s)
    if cleanup is not None:
        await cleanup()


def _exit_stuck(limit_s: float) -> None:
    """The backstop thread: the event loop did not end the stop within ``limit_s``; every thread's stack to
    stderr (the log), then exit 1."""
    sys.stderr.write(f"stopping did not finish within {limit_s:.0f} s and the event loop does not answer: "
                     "exiting with status 1; every thread's stack:\n")
    faulthandler.dump_traceback(all_threads=True)
    _flush_and_exit(1)


def _flush_and_exit(code: int) -> None:
    try:
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)  # not sys.exit: the stuck tasks and threads would be waited for again on the way out

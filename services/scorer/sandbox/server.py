"""``fastexp serve sandbox``: a SandboxFusion-compatible HTTP sandbox over the bubblewrap backend.

Deployments run it as a container of its own, with no secrets and no network egress, and point the scorer's
``sandbox.backend: remote`` at it: tool code then never runs in the scorer's container (``deploy/``). FastAPI +
uvicorn.

``POST /run_code`` takes SandboxFusion's request (``code``, ``language`` = ``python``, ``run_timeout`` seconds,
``memory_limit_MB``; ``stdin``, ``files`` and ``fetch_files`` must be empty) and answers its response (``status``
``Success`` / ``Failed`` / ``SandboxError``, ``run_result`` with ``status`` ``Finished`` / ``TimeLimitExceeded`` /
``Error``, ``return_code``, ``stdout``, ``stderr``, ``execution_time`` seconds). A request's limits are capped by
the server's (``max_timeout_s``, ``max_memory_bytes``); bad input is HTTP 400 naming the field; a missing or
unknown bearer token (when ``auth_tokens_file`` or ``admin_tokens_file`` is set: either file's tokens may call)
is 401, checked before the body is read. ``GET /health`` is 200 once the probe ran. The server refuses to start
where the probe fails (the cause and the fix named). It runs on :func:`services.common.http_edge.edge_config`
(headers bounded, at most ``max_connections`` at once).

A caller that hangs up (its deadline, a cancelled episode: the scorer's ``RemoteSandbox`` closes its connection)
ends its run: the server checks the connection every :data:`DISCONNECT_POLL_S` seconds while the run goes on, and
cancels the run once the caller is gone (its whole tree killed and reaped, its slot freed), instead of running it
to its own timeout for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import ClassVar

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from services.common.http_edge import MAX_CONNECTIONS, run_edge, service_edge_config
from services.common.http_limits import BoundedBody, bearer_check
from services.common.http_tokens import edge_tokens
from services.common.security import check_exposure
from services.common.settings import ServiceSettings
from services.scorer.sandbox.base import MIB, Sandbox, SandboxError, SandboxLimits, SandboxResult
from services.scorer.sandbox.settings import SandboxSettings, build_sandbox

logger = logging.getLogger(__name__)

#: Seconds between two checks of a running call's connection (a run whose caller hung up is cancelled).
DISCONNECT_POLL_S = 0.25


class SandboxServerSettings(ServiceSettings):
    """The sandbox server: where it listens, its bubblewrap options and the most a request may ask for."""

    section: ClassVar[str] = "sandbox_server"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_SANDBOX_SERVER_", extra="forbid", env_nested_delimiter="__")

    port: int = Field(8080, ge=0, le=65535)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description="bubblewrap options")
    max_timeout_s: float = Field(30.0, gt=0, description="largest run_timeout a request may ask for")
    max_memory_bytes: int = Field(1024 * MIB, ge=16 * MIB, description="largest memory a request may ask for")
    cpu_s: int = Field(10, ge=1, description="CPU seconds of every run")
    max_output_bytes: int = Field(64 * 1024, ge=1024, description="stdout and stderr kept of every run")
    max_file_bytes: int = Field(16 * MIB, ge=1024, description="bytes any file a run writes may reach")
    max_code_bytes: int = Field(1 * MIB, ge=1024, description="largest program accepted")
    max_body_bytes: int = Field(8 * MIB, ge=1024, description="largest request body (the program JSON-encoded); "
                                                             "bigger ones are 413, unread, after the token check")
    max_connections: int = Field(MAX_CONNECTIONS, ge=1, description="connections held (and requests running) at "
                                 "once; a connection past it is answered 503, unread")


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``/run_code`` request (the fields fastexp's sandbox honours)."""

    code: str
    language: str = "python"
    run_timeout: float = Field(10.0, gt=0, description="wall-clock seconds")
    memory_limit_MB: int = Field(-1, description="address space in MiB; -1: the server's maximum")  # noqa: N815
    compile_timeout: float = Field(10.0, description="ignored: Python is not compiled")
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    tenant: str = Field("", max_length=256, description="fastexp's: who the run is for (the scorer sends the "
                        "experience run's or request's id); the server's slots are shared fairly between tenants")


def limits_for(request: RunCodeRequest, settings: SandboxServerSettings) -> SandboxLimits:
    """The run's limits: the request's wall clock and memory within the server's maxima, the server's others.

    Raises:
        ValueError: a field the server does not support or a program over ``max_code_bytes`` (field named).
    """
    if request.language != "python":
        raise ValueError(f"language: only 'python' runs here, not {request.language!r}")
    for name in ("stdin", "files", "fetch_files"):
        if getattr(request, name):
            raise ValueError(f"{name}: not supported by this sandbox; send the program alone")
    if len(request.code.encode()) > settings.max_code_bytes:
        raise ValueError(f"code: over {settings.max_code_bytes} bytes")
    memory = settings.max_memory_bytes if request.memory_limit_MB <= 0 else request.memory_limit_MB * MIB
    return SandboxLimits(
        timeout_s=min(request.run_timeout, settings.max_timeout_s), cpu_s=settings.cpu_s,
        memory_bytes=min(memory, settings.max_memory_bytes), max_output_bytes=settings.max_output_bytes,
        max_file_bytes=settings.max_file_bytes,
    )


def run_code_response(result: SandboxResult, seconds: float) -> dict[str, object]:
    """A :class:`SandboxResult` in SandboxFusion's response shape."""
    run_status = "TimeLimitExceeded" if result.stopped == "timeout" else "Finished"
    return {
        "status": "Success" if result.exit_code == 0 and not result.stopped else "Failed",
        "message": "", "compile_result": None, "files": {},
        "run_result": {"status": run_status, "execution_time": round(seconds, 4), "return_code": result.exit_code,
                       "stdout": result.stdout, "stderr": result.stderr},
    }


def create_app(sandbox: Sandbox, settings: SandboxServerSettings) -> FastAPI:
    """The FastAPI app over ``sandbox`` (already probed): every route but ``/health`` takes a token of
    ``auth_tokens_file`` or ``admin_tokens_file`` when either is set (open only when neither is).

    Raises:
        SecurityConfigError: a token file that is set is unreadable or holds no token.
    """
    tokens = edge_tokens(settings)  # never empty where a token file is set
    app = FastAPI(title="fastexp sandbox")
    # the token, then the body's size, before a byte of the body is read (FastAPI parses it before any dependency)
    app.add_middleware(BoundedBody, max_bytes=settings.max_body_bytes, authorized=bearer_check(tokens))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "sandbox": sandbox.description}

    @app.post("/run_code")
    async def run_code(request: RunCodeRequest, http: Request) -> dict[str, object]:
        try:
            limits = limits_for(request, settings)
        except ValueError as error:
            raise HTTPException(400, str(error)) from error
        started = time.monotonic()
        try:
            result = await while_connected(sandbox.run(request.code, limits, request.tenant), http)
        except SandboxError as error:
            logger.error("sandbox run failed: %s", error)
            return {"status": "SandboxError", "message": str(error), "run_result": None}
        if result is None:
            logger.info("run_code: the caller hung up after %.1f s; its run was ended", time.monotonic() - started)
            return {"status": "SandboxError", "message": "the caller hung up", "run_result": None}
        return run_code_response(result, time.monotonic() - started)

    return app


async def while_connected(run: Coroutine[object, object, SandboxResult], http: Request,
                          poll_s: float = DISCONNECT_POLL_S) -> SandboxResult | None:
    """Await ``run`` while the caller of ``http`` stays connected; once it hangs up, cancel ``run`` (the sandbox
    ends the run's tree before the cancellation completes) and return None."""
    task = asyncio.ensure_future(run)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()
    finally:
        if not task.done():  # this handler itself was cancelled: the run goes with it
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def server_config(sandbox: Sandbox, settings: SandboxServerSettings) -> uvicorn.Config:
    """How :func:`serve` serves ``sandbox``: :func:`create_app` on the HTTP edges' uvicorn configuration.

    Raises:
        SecurityConfigError: a token file that is set is unreadable or holds no token.
    """
    return service_edge_config(create_app(sandbox, settings), settings, settings.max_connections)


def serve(settings: SandboxServerSettings) -> None:
    """Probe the sandbox, then serve until SIGTERM/SIGINT (blocking).

    Raises:
        SandboxUnavailable: the probe failed (before the port is opened).
        SecurityConfigError: bound beyond loopback without TLS or tokens and not ``insecure``; a token file is
            unreadable.
    """
    check_exposure(settings.host, secured=settings.secured(), insecure=settings.insecure, service="sandbox")

    async def main() -> None:
        sandbox = build_sandbox(settings.sandbox)
        await sandbox.check()
        logger.info("sandbox server: %s, on %s:%d", sandbox.description, settings.host, settings.port)
        await run_edge(server_config(sandbox, settings))

    asyncio.run(main())

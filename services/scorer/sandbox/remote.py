"""Tool runs on a remote sandbox over HTTP, in SandboxFusion's API (what verl and SkyRL call).

``POST {url}/run_code`` with ``{"code", "language": "python", "run_timeout", "memory_limit_MB", "tenant"}`` answers
``{"status": "Success" | "Failed" | "SandboxError", "message", "run_result": {"status": "Finished" |
"TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr", "execution_time"}}``. SandboxFusion itself or
fastexp's own ``fastexp serve sandbox`` (:mod:`services.scorer.sandbox.server`) answer it. ``tenant`` is fastexp's
own field (who the run is for: the server shares its slots fairly between tenants); SandboxFusion ignores it. For clusters that must not
run untrusted code in the scorer's container at all.

Every call has one total deadline (the run's ``timeout_s`` plus ``margin_s``, not a per-read timeout) and the
response body is read only up to ``max_response_bytes``.
"""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx

from services.common.bodies import ACCEPT_ENCODING, ReplyTooLarge, read_capped
from services.scorer.sandbox.base import (
    MIB,
    PROBE_CODE,
    PROBE_OUTPUT,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    cut,
)


class RemoteSandbox:
    """A SandboxFusion-compatible endpoint at ``url`` (module docs); ``token``: sent as ``Authorization: Bearer``;
    ``verify``: TLS verification (``True``, ``False``, a CA bundle path, or an SSL context: with the scorer's own
    certificate for mutual TLS, :func:`services.scorer.outbound.tls.client_tls`)."""

    def __init__(self, url: str, token: str | None = None, margin_s: float = 5.0,
                 max_response_bytes: int = 4 * MIB, verify: bool | str | ssl.SSLContext = True) -> None:
        self._url = url.rstrip("/") + "/run_code"
        self._margin_s = margin_s
        self._max_response_bytes = max_response_bytes
        headers = {"Accept-Encoding": ACCEPT_ENCODING, **({"Authorization": f"Bearer {token}"} if token else {})}
        self._client = httpx.AsyncClient(headers=headers, verify=verify, timeout=None)
        self.description = f"remote sandbox {self._url}"

    async def run(self, code: str, limits: SandboxLimits, tenant: str = "") -> SandboxResult:
        """Run ``code`` remotely under ``limits`` for ``tenant`` (wall clock, memory and the tenant travel; the
        remote side keeps its own CPU, file and process limits).

        Raises:
            SandboxError: unreachable, an HTTP error, past the deadline, a body over the cap, or a sandbox error
                reported by the remote side (each named).
        """
        request = {"code": code, "language": "python", "run_timeout": limits.timeout_s,
                   "memory_limit_MB": max(1, limits.memory_bytes // MIB), "tenant": tenant}
        try:
            async with asyncio.timeout(limits.timeout_s + self._margin_s):
                body = await self._post(request)
        except TimeoutError as error:
            raise SandboxError(f"{self._url}: no answer within {limits.timeout_s + self._margin_s:.0f} s") from error
        except httpx.HTTPError as error:
            raise SandboxError(f"{self._url}: {type(error).__name__}: {error}") from error
        return _result(body, limits, self._url)

    async def check(self) -> None:
        """Run the probe remotely.

        Raises:
            SandboxUnavailable: the endpoint is unreachable or does not run the probe correctly.
        """
        try:
            result = await self.run(PROBE_CODE, SandboxLimits(timeout_s=30.0))
        except SandboxError as error:
            raise SandboxUnavailable(f"{error}. Fix: start the sandbox service and check sandbox.remote_url") from error
        if result.stdout.strip() != PROBE_OUTPUT:
            raise SandboxUnavailable(f"{self._url} ran the probe but printed {result.stdout.strip()!r}")

    async def close(self) -> None:
        await self._client.aclose()

    async def _post(self, request: dict) -> dict:
        async with self._client.stream("POST", self._url, json=request) as response:
            try:
                data = await read_capped(response, self._max_response_bytes, "the response cap")
            except ReplyTooLarge as error:
                raise SandboxError(f"{self._url}: {error}") from None
        if response.status_code != 200:
            raise SandboxError(f"{self._url}: HTTP {response.status_code}: {bytes(data[:300]).decode(errors='replace')}")
        try:
            return json.loads(data)
        except ValueError as error:
            raise SandboxError(f"{self._url}: the answer is not JSON") from error


def _result(body: dict, limits: SandboxLimits, url: str) -> SandboxResult:
    """SandboxFusion's answer as a :class:`SandboxResult` (``status`` "SandboxError": :class:`SandboxError`)."""
    run = body.get("run_result") if isinstance(body, dict) else None
    if body.get("status") == "SandboxError" or not isinstance(run, dict):
        raise SandboxError(f"{url}: {body.get('message') or 'no run_result in the answer'}")
    stopped = {"TimeLimitExceeded": "timeout"}.get(run.get("status", ""), "")
    return_code = run.get("return_code")
    exit_code = return_code if isinstance(return_code, int) else (0 if run.get("status") == "Finished" else 1)
    return SandboxResult(
        stdout=cut(str(run.get("stdout") or "").encode(), limits.max_output_bytes),
        stderr=cut(str(run.get("stderr") or "").encode(), limits.max_output_bytes),
        exit_code=exit_code, stopped=stopped,
    )

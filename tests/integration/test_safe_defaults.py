"""Safe defaults (issue 30, part 4): a service bound beyond loopback with neither TLS nor tokens refuses to start
unless its settings say ``insecure: true`` (then it warns); loopback, tokens or TLS start as before.

Real start attempts: the shared ``start_service`` every service starts through, and the real ``fastexp serve``
process."""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastexp.security import SecurityConfigError
from services.common.security import is_loopback
from services.common.server import start_service
from services.generator.settings import GeneratorSettings

SERVICE = "fastexp.v1.GenerationService"


def _nothing(server: grpc.aio.Server) -> None:
    """No servicer: health and reflection are enough to see the server start."""


async def _started(settings: GeneratorSettings) -> str:
    running = await start_service(settings, SERVICE, _nothing)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    finally:
        await running.stop(0)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "fastexp-generator"])  # noqa: S104
def test_loopback_is_told_from_exposed_hosts(host):
    assert not is_loopback(host)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("[::1]")


async def test_an_exposed_plaintext_server_without_tokens_refuses_to_start_naming_the_fix():
    with pytest.raises(SecurityConfigError) as refused:
        await start_service(GeneratorSettings(host="0.0.0.0", port=0), SERVICE, _nothing)  # noqa: S104
    message = str(refused.value)
    assert message.startswith("host: ") and "0.0.0.0" in message
    assert "auth_tokens_file" in message and "tls_cert_file" in message and "insecure: true" in message


async def test_insecure_true_starts_an_exposed_server_and_warns_loudly(caplog):
    with caplog.at_level(logging.WARNING, logger="services.common.security"):
        status = await _started(GeneratorSettings(host="0.0.0.0", port=0, insecure=True))  # noqa: S104
    assert status == "SERVING"
    assert any(r.levelno == logging.WARNING and "INSECURE" in r.getMessage() for r in caplog.records)


async def test_tokens_or_loopback_start_without_insecure(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token\n")
    assert await _started(GeneratorSettings(host="0.0.0.0", port=0, auth_tokens_file=tokens)) == "SERVING"  # noqa: S104
    assert await _started(GeneratorSettings(host="127.0.0.1", port=0)) == "SERVING"


def test_the_cli_refuses_an_exposed_unsecured_generator_before_loading_its_model(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "generator", "--host", "0.0.0.0", "--port", "0"],  # noqa: S104
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refuses to start: host: " in done.stderr and "insecure: true" in done.stderr

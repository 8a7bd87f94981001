"""Every HTTP edge checks the caller and bounds the body before reading it (issue 44, item 5), on real uvicorn
servers: the sandbox server, the experience service's OpenAI-compatible gateway and the reference reward server.
A request declaring a 300 MiB body and sending none is answered at once (401 without a valid token, 413 with
one): had the server read the body first, the answer would never come (the test's socket waits 10 s). A chunked
body is cut off with 413 as soon as it passes the limit. The reward server refuses to listen beyond loopback
without tokens, as the gRPC services do."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import pytest

from services.common.security import SecurityConfigError
from services.experience.gateway.app import create_app as gateway_app
from services.experience.gateway.sessions import SessionRegistry
from services.scorer.composition import build_composer
from services.scorer.http_server import create_app as reward_app
from services.scorer.http_server import serve as serve_reward_server
from services.scorer.sandbox.bubblewrap import BubblewrapSandbox
from services.scorer.sandbox.server import SandboxServerSettings
from services.scorer.sandbox.server import create_app as sandbox_app
from services.scorer.settings import RewardServerSettings, ScorerSettings
from tests.support.http_servers import serving

TOKEN = b"edge-token-5a1f"  # noqa: S105 - test credential
HUGE = 300 * 1024 * 1024
RULES = [{"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}]


def _status_line(url: str, path: str, headers: dict[str, str], chunks: int = 0) -> bytes:
    """Send a POST's headers (and ``chunks`` 1 MiB chunks of a chunked body, as long as the server reads them),
    then read the status line, within 10 s."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{head}\r\n".encode())
        try:
            for _ in range(chunks):
                connection.sendall(b"100000\r\n" + b" " * 0x100000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: its answer is waiting
        return connection.recv(4096).split(b"\r\n", 1)[0]


def _check_edge(url: str, path: str, limit_mib: int) -> None:
    declared = {"Content-Length": str(HUGE)}
    assert b" 401 " in _status_line(url, path, declared)  # no token: refused before the body
    assert b" 401 " in _status_line(url, path, {**declared, "Authorization": "Bearer wrong"})
    authorized = {"Authorization": f"Bearer {TOKEN.decode()}"}
    assert b" 413 " in _status_line(url, path, {**declared, **authorized})  # too big: refused unread
    chunked = {**authorized, "Transfer-Encoding": "chunked"}
    assert b" 413 " in _status_line(url, path, chunked, chunks=limit_mib + 4)  # cut off once past the limit


def test_the_sandbox_server_checks_the_token_and_the_size_before_reading(tmp_path):
    (tmp_path / "tokens").write_bytes(TOKEN + b"\n")
    settings = SandboxServerSettings(max_body_bytes=2 * 1024 * 1024, auth_tokens_file=tmp_path / "tokens")
    with serving(sandbox_app(BubblewrapSandbox(), settings)) as url:
        _check_edge(url, "/run_code", 2)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # health stays open


def test_the_gateway_checks_the_key_and_the_size_before_reading():
    with serving(gateway_app(None, SessionRegistry(), [TOKEN], max_body_bytes=2 * 1024 * 1024)) as url:
        _check_edge(url, "/v1/chat/completions", 2)
        refused = httpx.post(f"{url}/v1/chat/completions", json={}, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_the_reward_server_checks_the_token_and_the_size_before_reading():
    composer = build_composer(ScorerSettings(sources=RULES))
    with serving(reward_app(composer, tokens=[TOKEN], max_body_bytes=2 * 1024 * 1024)) as url:
        _check_edge(url, "/get_reward", 2)
        answered = httpx.post(f"{url}/get_reward", json={"query": ["1 + 1 = 2"], "references": ["2"]},
                              headers={"Authorization": f"Bearer {TOKEN.decode()}"}, timeout=30)
        assert answered.status_code == 200 and len(answered.json()["rewards"]) == 1


def test_the_reward_server_follows_the_grpc_services_rule_beyond_loopback():
    with pytest.raises(SecurityConfigError, match="reward-server"):
        serve_reward_server(RewardServerSettings(host="0.0.0.0", sources=RULES))

"""The three HTTP edges bound what they read before any check runs, on real uvicorn servers configured the way
their ``serve`` configures them (``server_config`` / ``start_gateway``, i.e. :mod:`services.common.http_edge`):

- a request whose headers pass the bound (64 KiB) is refused (400) or its connection closed as soon as they do,
  without a token: the caller could not get the 64 MiB header it tries to send into the server (had the server
  read it all, as uvicorn's default httptools parser does, the whole of it would go out and no answer would come);
- a chunked body's trailers are bounded the same way, with a valid token;
- past ``max_connections`` a connection is answered 503 unread, and requests on held connections are served;
- a request head that does not arrive whole within its deadline has its connection closed;
- a request body that does not arrive whole within its deadline is answered 408;
- TLS connections are bounded and their handshakes timed before the handshake's buffers exist;
- the sandbox server with an admin token file alone takes that token and refuses calls without one;
- mutual TLS (``tls_client_ca_file``) on the sandbox and reward servers and the gateway admits only the CA's
  clients.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import httpx
import psutil
import pytest

from services.common.http_edge import MAX_HEAD_BYTES, edge_config, service_edge_config
from services.common.http_limits import BoundedBody
from services.common.security import SecurityConfigError
from services.experience.gateway.app import create_app as gateway_app
from services.experience.gateway.serving import start_gateway
from services.experience.gateway.sessions import SessionRegistry
from services.scorer.composition import build_composer
from services.scorer.config import RemoteConfig
from services.scorer.http_server import create_app as reward_app
from services.scorer.http_server import server_config as reward_config
from services.scorer.outbound.tls import client_tls
from services.scorer.remote import RemoteScorer
from services.scorer.sandbox import RemoteSandbox, SandboxLimits
from services.scorer.sandbox.bubblewrap import BubblewrapSandbox
from services.scorer.sandbox.server import SandboxServerSettings
from services.scorer.sandbox.server import server_config as sandbox_config
from services.scorer.scorer import ScoreItem
from services.scorer.settings import RewardServerSettings
from tests.support.certs import make_pki
from tests.support.http_servers import serving_config

TOKEN = b"edge-token-7c2e"  # noqa: S105 - test credential
ADMIN = b"edge-admin-93b1"  # noqa: S105 - test credential
MIB = 1024 * 1024
ATTEMPT_MIB = 64  # what the caller tries to send
RULES = [{"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}]


def _flood(port: int, head: bytes, line: bytes, lines: int) -> tuple[int, bytes]:
    """Send ``head`` then ``line`` ``lines`` times, as long as the server takes them, then read its answer
    (within 10 s). Returns the bytes sent and the status line (b"" where the server closed the connection)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        try:
            connection.sendall(head)
            for _ in range(lines):
                connection.sendall(line)
                sent += len(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on the request and closed the connection
        try:
            answer = connection.recv(4096)
        except ConnectionResetError:
            answer = b""
    return sent, answer.split(b"\r\n", 1)[0]


def _check_refused_early(port: int, head: bytes, line: bytes) -> None:
    """The server answers 400 or closes the connection long before ``ATTEMPT_MIB`` MiB went out, and its process
    (this one) does not grow by that much."""
    process = psutil.Process()
    before = process.memory_info().rss
    sent, status = _flood(port, head, line, ATTEMPT_MIB * MIB // len(line))
    grown = process.memory_info().rss - before
    assert status == b"" or status.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), status
    # what went out fits in the kernel's socket buffers; the server itself kept at most MAX_HEAD_BYTES of it
    assert sent < ATTEMPT_MIB * MIB // 2, f"{sent} bytes went out before the server gave up"
    assert grown < ATTEMPT_MIB * MIB // 2, f"the server grew by {grown} bytes"


def _big_header(path: str) -> tuple[bytes, bytes]:
    """A POST's head without a token, whose one header value goes on in 1 MiB lines of ``a`` (no line ends)."""
    return f"POST {path} HTTP/1.1\r\nHost: test\r\nX-Big: ".encode(), b"a" * MIB


def _big_trailers(path: str) -> tuple[bytes, bytes]:
    """A POST with a valid token and a small chunked body, then 1 MiB trailer lines."""
    body = b'{"code": "print(2)"}'
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {TOKEN.decode()}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    return head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n", b"X-Trailer: " + b"t" * (MIB - 13) + b"\r\n"


def _sandbox_settings(tmp_path, **overrides) -> SandboxServerSettings:
    (tmp_path / "tokens").write_bytes(TOKEN + b"\n")
    return SandboxServerSettings(port=0, auth_tokens_file=tmp_path / "tokens", **overrides)


@pytest.mark.parametrize("flood", [_big_header, _big_trailers], ids=["header", "trailers"])
def test_the_sandbox_server_bounds_headers_and_trailers(tmp_path, flood):
    with serving_config(sandbox_config(BubblewrapSandbox(), _sandbox_settings(tmp_path))) as port:
        _check_refused_early(port, *flood("/run_code"))
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200  # still serving


@pytest.mark.parametrize("flood", [_big_header, _big_trailers], ids=["header", "trailers"])
def test_the_reward_server_bounds_headers_and_trailers(tmp_path, flood):
    (tmp_path / "tokens").write_bytes(TOKEN + b"\n")
    settings = RewardServerSettings(port=0, sources=RULES, auth_tokens_file=tmp_path / "tokens")
    with serving_config(reward_config(build_composer(settings), settings)) as port:
        _check_refused_early(port, *flood("/get_reward"))


@pytest.mark.parametrize("flood", [_big_header, _big_trailers], ids=["header", "trailers"])
async def test_the_gateway_bounds_headers_and_trailers(flood):
    running = start_gateway(gateway_app(None, SessionRegistry(), [TOKEN]), "127.0.0.1", 0, grace_s=1)
    try:
        await asyncio.to_thread(_check_refused_early, running.port, *flood("/v1/chat/completions"))
    finally:
        await running.stop()


def test_a_head_within_the_bound_is_read(tmp_path):
    with serving_config(sandbox_config(BubblewrapSandbox(), _sandbox_settings(tmp_path))) as port:
        answered = httpx.get(f"http://127.0.0.1:{port}/health", headers={"X-Big": "a" * (MAX_HEAD_BYTES // 2)},
                             timeout=10)
        assert answered.status_code == 200


def _status_line(connection: socket.socket) -> bytes:
    """The first line the server sends on ``connection`` (b"" where it closes it unanswered), within 10 s."""
    try:
        return connection.recv(4096).split(b"\r\n", 1)[0]
    except ConnectionResetError:
        return b""


def test_past_max_connections_a_connection_is_answered_503_unread(tmp_path):
    with serving_config(sandbox_config(BubblewrapSandbox(), _sandbox_settings(tmp_path, max_connections=2))) as port:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            for connection in held:  # a slow caller's partial request, held
                connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
            # a flood past the bound: each connection is answered at once, whatever (and however much) it sends
            flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
            try:
                for connection in flood:
                    connection.sendall(b"POST /run_code HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * 60_000)
                answers = [_read_to_end(connection) for connection in flood]
                for answer in answers:  # a whole response: its length is its body's
                    head, _, body = answer.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 503 Service Unavailable"), answer
                    assert f"content-length: {len(body)}".encode() in head and body.startswith(b"Too many"), answer
            finally:
                for connection in flood:
                    connection.close()
            held[0].sendall(b"\r\n")  # requests on held connections are served
            assert _status_line(held[0]) == b"HTTP/1.1 200 OK"
        finally:
            for connection in held:
                connection.close()


def _read_to_end(connection: socket.socket) -> bytes:
    """Everything the server sends on ``connection`` until it closes it (socket timeout: 10 s)."""
    chunks = []
    try:
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _ok_app():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_a_request_head_has_a_deadline():
    with serving_config(edge_config(_ok_app(), "127.0.0.1", 0, grace_s=1, lifespan="off", head_timeout_s=0.5)) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:  # never finishes its head
            slow.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n")
            started = time.monotonic()
            assert slow.recv(4096) == b""  # closed by the server, unanswered
            assert time.monotonic() - started < 9
        with socket.create_connection(("127.0.0.1", port), timeout=10) as kept:  # kept alive, then slow
            kept.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            assert _status_line(kept) == b"HTTP/1.1 200 OK"
            kept.sendall(b"GET / HTTP/1.1\r\n")
            assert kept.recv(4096) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as early:  # answered before its body came
            early.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\n")
            assert _status_line(early) == b"HTTP/1.1 200 OK"
            early.sendall(b"x")  # then the body goes on, slowly: the deadline covers it too (a 10 s hold times out)
            assert _read_to_end(early) in (b"", b"ok")


def test_tls_connections_are_bounded_and_their_handshakes_timed_before_any_buffer(tmp_path):
    # the sixth review held 2,000 connections that sent 11 bytes of a ClientHello: 605 MB and 2,007 descriptors for
    # 61 s, past max_connections 8 (the loop's TLS server allocated each one's buffers before the edge saw it)
    pki = make_pki(tmp_path)
    config = edge_config(_ok_app(), "127.0.0.1", 0, grace_s=1, lifespan="off", max_connections=4,
                         head_timeout_s=0.5, cert_file=pki.server_cert, key_file=pki.server_key)
    hello = bytes.fromhex("160301020001000001fc0303")[:11]
    with serving_config(config) as port:
        stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        try:
            for connection in stalled:
                connection.sendall(hello)
            # every one is closed unanswered: those past the bound at once, the others at the handshake's deadline
            assert {_status_line(connection) for connection in stalled} == {b""}
        finally:
            for connection in stalled:
                connection.close()
        context = ssl.create_default_context(cafile=str(pki.ca))
        answered = httpx.get(f"https://127.0.0.1:{port}/", verify=context, timeout=10)  # the slots came back
        assert answered.status_code == 200 and answered.text == "ok"


def test_a_request_body_has_a_deadline():
    # the sixth review kept a connection past 40 s with a valid token and a body sent a byte every 5 s
    async def echo(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    app = BoundedBody(echo, max_bytes=1024, body_timeout_s=0.5)
    with serving_config(edge_config(app, "127.0.0.1", 0, grace_s=1, lifespan="off")) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\nx")  # then nothing
            assert _status_line(slow) == b"HTTP/1.1 408 Request Timeout"
        answered = httpx.post(f"http://127.0.0.1:{port}/", content=b"y" * 100, timeout=10)  # a whole body in time
        assert answered.status_code == 200 and answered.content == b"y" * 100


async def test_the_sandbox_server_takes_an_admin_token_file_alone(tmp_path):
    (tmp_path / "admin").write_bytes(ADMIN + b"\n")
    sandbox = BubblewrapSandbox()
    await sandbox.check()
    settings = SandboxServerSettings(port=0, admin_tokens_file=tmp_path / "admin")
    with serving_config(sandbox_config(sandbox, settings)) as port:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            program = {"code": "print(1 + 1)"}
            assert (await client.post("/run_code", json=program)).status_code == 401
            wrong = await client.post("/run_code", json=program, headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401
            ran = await client.post("/run_code", json=program, headers={"Authorization": f"Bearer {ADMIN.decode()}"})
            assert ran.status_code == 200 and ran.json()["run_result"]["stdout"].strip() == "2", ran.text


def test_a_sandbox_server_with_an_empty_token_file_does_not_start_open(tmp_path):
    (tmp_path / "admin").write_bytes(b"# no token yet\n")
    with pytest.raises(SecurityConfigError, match="admin_tokens_file"):
        sandbox_config(BubblewrapSandbox(), SandboxServerSettings(port=0, admin_tokens_file=tmp_path / "admin"))


async def test_mutual_tls_on_the_sandbox_and_reward_servers_and_the_gateway_admits_only_the_cas_clients(tmp_path):
    # tls_client_ca_file on an HTTP edge means what it means on a gRPC port: a client without a certificate that
    # CA signed fails the handshake (the edge would otherwise be open to anyone, with no token files set); the
    # scorer's remote sandbox and remote reward source present theirs
    pki = make_pki(tmp_path)
    tls = {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key, "tls_client_ca_file": pki.ca}
    trusted = client_tls(pki.ca, pki.client_cert, pki.client_key, "sandbox.remote_")
    sandbox = BubblewrapSandbox()
    await sandbox.check()
    with serving_config(sandbox_config(sandbox, SandboxServerSettings(port=0, **tls))) as port:
        url = f"https://127.0.0.1:{port}"
        for stranger in (client_tls(pki.ca, None, None, "no certificate: "),
                         client_tls(pki.ca, pki.rogue_client_cert, pki.rogue_client_key, "another CA's: ")):
            async with httpx.AsyncClient(verify=stranger, timeout=30) as client:
                with pytest.raises(httpx.TransportError):
                    await client.post(f"{url}/run_code", json={"code": "print(1)"})
        remote = RemoteSandbox(url, verify=trusted)
        try:
            assert (await remote.run("print(1 + 1)", SandboxLimits(timeout_s=30.0))).stdout.strip() == "2"
        finally:
            await remote.close()
    settings = RewardServerSettings(port=0, sources=RULES, **tls)  # the app starts its sources: `serve` starts them
    with serving_config(service_edge_config(reward_app(build_composer(settings)), settings)) as port:
        source = RemoteScorer(RemoteConfig(name="rm", url=f"https://127.0.0.1:{port}/get_reward", tls_ca_file=pki.ca,
                                           tls_cert_file=pki.client_cert, tls_key_file=pki.client_key))
        await source.start()
        try:
            scored = await source.score([ScoreItem("Q: 2+2? \\boxed{4}", "Q: 2+2?", " \\boxed{4}", "", "4")])
        finally:
            await source.close()
        assert scored.errors == (None,) and scored.rewards.tolist() == [1.0], scored
        async with httpx.AsyncClient(verify=client_tls(pki.ca, None, None, ""), timeout=30) as client:
            with pytest.raises(httpx.TransportError):
                await client.post(f"https://127.0.0.1:{port}/get_reward", json={"query": ["x"]})
    # the experience service's gateway, as its server starts it with the service's TLS settings (no token files:
    # the certificate is the credential, as on its gRPC port)
    gateway = start_gateway(gateway_app(None, SessionRegistry(), []), "127.0.0.1", 0, grace_s=1,
                            cert_file=pki.server_cert, key_file=pki.server_key, client_ca_file=pki.ca)
    try:
        for verify, admitted in ((client_tls(pki.ca, None, None, ""), False), (trusted, True)):
            async with httpx.AsyncClient(verify=verify, timeout=30) as client:
                if admitted:  # past TLS: the app's own answer (this gateway has no fleet behind it)
                    assert (await client.get(f"https://127.0.0.1:{gateway.port}/v1/models")).status_code != 401
                else:
                    with pytest.raises(httpx.TransportError):
                        await client.get(f"https://127.0.0.1:{gateway.port}/v1/models")
    finally:
        await gateway.stop()

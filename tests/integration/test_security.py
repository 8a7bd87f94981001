"""TLS, mutual TLS and bearer tokens on the three services, with certificates the test makes: the experience
service reaches the generator and scorer over mTLS with an admin token; a trainer needs a client certificate
and a token; UpdateWeights needs the admin privilege; health stays open; no token reaches the logs."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from fastexp import ExperienceClient, Sampling, build_request, update_generator_weights
from fastexp.security import ClientTLS, SecurityConfigError
from fastexp.v1 import experience_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.generator.settings import GeneratorSettings
from services.scorer.settings import ScorerSettings
from tests.support.certs import make_pki
from tests.support.stack import MATH_VERIFY_OR_ZERO, three_services

CALL_TOKEN = "trainer-token-5f1c"  # noqa: S105 - test credentials
ADMIN_TOKEN = "admin-token-93ab"  # noqa: S105


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    pki = make_pki(folder)
    (folder / "call-tokens").write_text(f"# trainers\n{CALL_TOKEN}\n")
    (folder / "admin-tokens").write_text(f"{ADMIN_TOKEN}\n")
    return pki, folder


def _server_security(pki, folder) -> dict:
    return {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key, "tls_client_ca_file": pki.ca,
            "auth_tokens_file": folder / "call-tokens", "admin_tokens_file": folder / "admin-tokens"}


@pytest.fixture(scope="module")
async def secured(tiny_model_path, pki):
    pki, folder = pki
    security = _server_security(pki, folder)
    async with three_services(
        tiny_model_path, host="localhost", generator=security, scorer={"sources": [MATH_VERIFY_OR_ZERO], **security},
        experience={"upstream_tls_ca_file": pki.ca, "upstream_tls_cert_file": pki.client_cert,
                    "upstream_tls_key_file": pki.client_key, "upstream_token_file": folder / "admin-tokens",
                    **security},
    ) as running:
        yield {"pki": pki, "experience": running.experience_address, "generator": running.generator_address}


def _tls(pki, rogue: bool = False, client_cert: bool = True) -> ClientTLS:
    if rogue:
        return ClientTLS(pki.ca, pki.rogue_client_cert, pki.rogue_client_key)
    return ClientTLS(pki.ca, pki.client_cert, pki.client_key) if client_cert else ClientTLS(pki.ca)


def _aio_channel(address: str, tls: ClientTLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.credentials())


def _request():
    return build_request(["What is 2 + 3?"], n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4))


async def _make(address: str, tls: ClientTLS | None, token: str | None) -> grpc.StatusCode:
    async with _aio_channel(address, tls) as channel:
        stub = experience_pb2_grpc.ExperienceServiceStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            async for _ in stub.MakeExperiences(_request(), timeout=60, metadata=metadata):
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_trainer_with_certificate_and_token_gets_experiences_over_mtls_end_to_end(secured, caplog):
    caplog.set_level(logging.DEBUG)
    pki = secured["pki"]

    def stream() -> list:
        with ExperienceClient(secured["experience"], timeout_s=120, tls=_tls(pki), token=CALL_TOKEN) as client:
            return list(client.make_experiences(["What is 2 + 3?", "Name a prime."], n_samples_per_prompt=2,
                                                sampling=Sampling(max_new_tokens=6)))

    batches = await asyncio.to_thread(stream)
    assert sum(len(e.reward) for e in batches) == 4  # generator and scorer reached over mTLS with the admin token
    assert await _make(secured["experience"], _tls(pki), None) == grpc.StatusCode.UNAUTHENTICATED
    assert await _make(secured["experience"], _tls(pki), "not-a-token") == grpc.StatusCode.UNAUTHENTICATED
    assert await _make(secured["experience"], _tls(pki), ADMIN_TOKEN) == grpc.StatusCode.OK
    logged = "\n".join(f"{r.getMessage()} {r.args}" for r in caplog.records)
    assert logged and CALL_TOKEN not in logged and ADMIN_TOKEN not in logged and "not-a-token" not in logged


@pytest.mark.parametrize("case", ["plaintext", "no client certificate", "certificate of another CA"])
async def test_connections_without_a_trusted_client_certificate_are_refused(secured, case):
    pki = secured["pki"]
    tls = {"plaintext": None, "no client certificate": _tls(pki, client_cert=False),
           "certificate of another CA": _tls(pki, rogue=True)}[case]
    assert await _make(secured["experience"], tls, CALL_TOKEN) == grpc.StatusCode.UNAVAILABLE


async def test_update_weights_needs_the_admin_privilege(secured):
    pki = secured["pki"]

    def update(token: str) -> grpc.StatusCode:
        try:
            update_generator_weights(secured["generator"], [("model.norm.weight", torch.ones(64))],
                                     tls=_tls(pki), token=token, timeout_s=60)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    assert await asyncio.to_thread(update, CALL_TOKEN) == grpc.StatusCode.PERMISSION_DENIED
    assert await asyncio.to_thread(update, "") == grpc.StatusCode.UNAUTHENTICATED
    async with _aio_channel(secured["generator"], _tls(pki)) as channel:
        info = await generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {CALL_TOKEN}"),))
    assert info.max_model_len == 256  # the call privilege covers everything else


async def test_health_needs_no_token_but_still_tls(secured):
    async with _aio_channel(secured["experience"], _tls(secured["pki"])) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_security_settings_are_checked_at_the_edge(pki, tmp_path):
    pki, folder = pki
    with pytest.raises(ValidationError, match="go together"):
        GeneratorSettings(tls_cert_file=pki.server_cert)
    with pytest.raises(ValidationError, match="needs tls_cert_file"):
        ScorerSettings(tls_client_ca_file=pki.ca)
    empty = tmp_path / "tokens"
    empty.write_text("# nobody\n\n")
    with pytest.raises(SecurityConfigError, match="auth_tokens_file: .* holds no token"):
        ScorerSettings(auth_tokens_file=empty).auth()
    with pytest.raises(SecurityConfigError, match="cannot read"):
        ScorerSettings(admin_tokens_file=tmp_path / "missing").auth()

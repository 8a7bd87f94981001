"""The experience service's limits over real gRPC (the three services in process, HF backend, tiny Llama, float32;
the generator and scorer behind gated proxies, tests/support/gates.py): a Generate or Score call that never answers
fails the stream at the service's deadline naming the service, and the service serves the next request; a second
UpdateWeights while one is in progress is refused and versions stay consistent; streams past
``max_concurrent_streams`` are refused while the accepted ones complete."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from fastexp import Sampling, build_request
from fastexp.v1 import generation_pb2
from fastexp.weights import weight_chunks
from fastexp.wire import experience_from_pb
from tests.support.gates import gated
from tests.support.stack import three_services

TIMEOUT_S = 5.0  # the experience service's generate_timeout_s and score_timeout_s here
MAX_STREAMS = 2


@pytest.fixture(scope="module")
async def stack(tiny_model_path, tmp_path_factory):
    staging = {name: tmp_path_factory.mktemp(f"staging-{name}") for name in ("generator", "experience")}
    gates = {}

    @contextlib.asynccontextmanager
    async def through_a_gate(name: str, address: str):
        async with gated(name, address) as (gated_address, gates[name]):
            yield gated_address

    async with three_services(
        tiny_model_path, generator={"weights_staging_dir": str(staging["generator"])}, route=through_a_gate,
        experience={"generate_timeout_s": TIMEOUT_S, "score_timeout_s": TIMEOUT_S,
                    "max_concurrent_streams": MAX_STREAMS, "weights_staging_dir": str(staging["experience"])},
    ) as running:
        yield {
            "experience": running.experience_stub, "health": running.health, "generator": running.generator_stub,
            "generate_gate": gates["generator"], "generator_address": running.upstream_addresses["generator"],
            "score_gate": gates["scorer"], "staging": staging,
        }


def _request(num_prompts: int = 1):
    prompts = [f"Count from {i}: {i}, {i + 1}," for i in range(num_prompts)]
    return build_request(prompts, n_samples_per_prompt=2, advantage_estimator="rloo",
                         sampling=Sampling(temperature=1.0, max_new_tokens=4))


async def _stream(stack, request=None, timeout_s: float = 120.0) -> list:
    calls = stack["experience"].MakeExperiences(request or _request(), timeout=timeout_s)
    return [experience_from_pb(m) async for m in calls]


async def _serving(stack, status: str) -> bool:
    """Whether the experience service's health is ``status``."""
    reply = await stack["health"].Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status) == status


# --- a hung upstream: the deadline path ------------------------------------------------------------------------

# the documented status of a hung upstream: the scorer's Score call fails at score_timeout_s (UpstreamTimeout,
# DEADLINE_EXCEEDED); a Generate call failing at generate_timeout_s takes its replica out and the fleet has no other
# (NotReady, UNAVAILABLE: "no generator replica left", with the replica's DEADLINE_EXCEEDED as the reason)
EXPECTED = {"generator": (grpc.StatusCode.UNAVAILABLE, "generator 127.0.0.1:", "DEADLINE_EXCEEDED"),
            "scorer": (grpc.StatusCode.DEADLINE_EXCEEDED, "scorer: DEADLINE_EXCEEDED", "")}


@pytest.mark.parametrize("service", ["generator", "scorer"])
async def test_a_hung_upstream_fails_the_stream_at_the_services_deadline_naming_it(stack, service):
    gate = stack["generate_gate" if service == "generator" else "score_gate"]
    arrived = gate.arrived
    gate.close()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _stream(stack)  # the trainer's own deadline (120 s) is far later than the service's (5 s)
    finally:
        gate.open()
    assert gate.arrived > arrived, f"the {service} never got the call"
    error = raised.value
    code, named, reason = EXPECTED[service]
    assert error.code() == code, error.details()
    assert named in error.details() and reason in error.details(), error.details()  # the service's, not the trainer's
    assert "undelivered prompt indices: 0" in error.details()
    # the service recovers by itself: serving, its replica routed again, and the next request is served
    replica = {"replica": stack["generator_address"]}
    await _until(lambda: REGISTRY.get_sample_value("fastexp_generator_replica_up", replica) == 1)
    await _until(lambda: _serving(stack, "SERVING"))
    [batch] = await _stream(stack)
    assert sorted(batch.prompt_index) == [0, 0]


# --- two UpdateWeights at once --------------------------------------------------------------------------------

def _norm_update(tensors: dict[str, torch.Tensor], policy_version: int | None = None):
    """One tensor (the final norm, unchanged values): an update that changes nothing but the version."""
    return list(weight_chunks([("model.norm.weight", tensors["model.norm.weight"])], policy_version=policy_version))


async def _held_update(stub, messages, release: asyncio.Event):
    """An UpdateWeights stream that sends ``messages`` and then holds the stream open until ``release`` is set."""

    async def iterator():
        for message in messages:
            yield message
        await release.wait()

    return await stub.UpdateWeights(iterator(), timeout=120)


async def _until(condition, timeout_s: float = 120.0) -> None:
    """Wait until ``condition()`` (a function, or a coroutine function) holds, checking it every 50 ms (polling a
    condition, not a delay)."""
    async def holds() -> bool:
        value = condition()
        return bool(await value) if asyncio.iscoroutine(value) else bool(value)

    async def check() -> None:
        while not await holds():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(check(), timeout_s)


def _staged(folder: Path):
    """Whether an update has staged a tensor under ``folder`` (it is then inside its update)."""
    return lambda: any(p.is_file() for p in folder.rglob("*"))


async def _generator_version(stack) -> int:
    return (await stack["generator"].GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)).policy_version


@pytest.mark.parametrize("service", ["experience", "generator"])
async def test_a_second_update_while_one_is_in_progress_is_refused_and_versions_stay_consistent(
    stack, tiny_model_path, service
):
    from safetensors.torch import load_file

    tensors = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    stub = stack[service]
    before = await _generator_version(stack)
    release = asyncio.Event()
    first = asyncio.create_task(_held_update(stub, _norm_update(tensors), release))
    try:
        await _until(_staged(stack["staging"][service]))  # the first is receiving its tensors
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.UpdateWeights(iter(_norm_update(tensors)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "another weight update is in progress" in refused.value.details()
    finally:
        release.set()
    response = await asyncio.wait_for(first, 120)
    assert response.policy_version == before + 1 == await _generator_version(stack)  # one update, counted once
    after = await stub.UpdateWeights(iter(_norm_update(tensors)), timeout=60)  # the next is accepted
    assert after.policy_version == before + 2 == await _generator_version(stack)
    [batch] = await _stream(stack)
    assert set(batch.policy_version) == {before + 2}
    if service == "experience":
        assert batch.actor_policy_version == before + 2


# --- max_concurrent_streams -----------------------------------------------------------------------------------

async def test_streams_past_max_concurrent_streams_are_refused_while_the_accepted_ones_complete(stack):
    gate = stack["generate_gate"]
    gate.close()  # the accepted streams wait in Generate: in flight, not finished
    accepted = [asyncio.create_task(_stream(stack, _request(2))) for _ in range(MAX_STREAMS)]
    try:
        await gate.wait_held(MAX_STREAMS)  # both reached the generator: the service serves them
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _stream(stack, timeout_s=30)
        assert not any(task.done() for task in accepted)  # refused while the others were in flight
    finally:
        gate.open()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_streams" in refused.value.details()
    for batches in await asyncio.wait_for(asyncio.gather(*accepted), 120):
        assert sorted(p for b in batches for p in b.prompt_index) == [0, 0, 1, 1]
    assert len(await _stream(stack)) == 1  # the cap counts open streams only


async def test_streams_arriving_together_past_max_concurrent_streams_are_refused(stack):
    """The cap holds for streams that arrive at once, not only one after another."""
    gate = stack["generate_gate"]
    gate.close()
    big = _request(200)  # decoding it takes a while: every call arrives before the first is decoded
    calls = [asyncio.create_task(_stream(stack, big)) for _ in range(MAX_STREAMS + 1)]
    try:
        # each call is either refused or waits in Generate
        await _until(lambda: sum(t.done() for t in calls) + gate.held == len(calls))
        refused = [t.exception() for t in calls if t.done()]
        codes = [e.code() if isinstance(e, grpc.aio.AioRpcError) else e for e in refused]
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED], codes
    finally:
        for task in calls:
            task.cancel()
        gate.open()
        await asyncio.gather(*calls, return_exceptions=True)

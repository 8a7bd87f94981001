"""Generator replicas found by name (services.experience.fleet.replicas) on real generator servers over the HF engine:
a replica that appears in the name's answer joins and gets work; one that disappears is drained (no new work,
closed once idle) and may come back; a failed resolution keeps the known replicas; ``dns:///`` names resolve."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from fastexp.sampling import SamplingOptions
from services.common.channels import open_channel
from services.common.deadlines import Deadline
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.fleet.clients import GeneratorClient
from services.experience.fleet.discovery import resolve_targets
from services.experience.fleet.generator_fleet import GeneratorFleet
from services.experience.fleet.readiness import ProbeSettings
from services.experience.fleet.replicas import FleetSettings, ReplicaState
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings

FAST = FleetSettings(probe=ProbeSettings(timeout_s=2.0, interval_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.2,
                                         backoff_jitter_s=0.05))


class Resolver:
    """The name's answer, as a headless Service's DNS would change it (the test sets ``answer``)."""

    def __init__(self) -> None:
        self.answer: list[str] | OSError = []

    async def __call__(self, targets) -> list[str]:
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


def _connect(address: str) -> GeneratorClient:
    return GeneratorClient(open_channel(address, 64 * 1024 * 1024), timeout_s=60, address=address)


async def _completions(fleet: GeneratorFleet, request: GenerationRequest, deadline: Deadline):
    """The fleet's completions (its SamplePreview notices left out: each sample comes again with its group)."""
    async for item in fleet.generate(request, deadline):
        if isinstance(item, CompletionRecord):
            yield item


def _request(count: int) -> GenerationRequest:
    return GenerationRequest(
        request_id="discovery", prompts=tuple((100 + i, 101, 102) for i in range(count)),
        sampling=SamplingOptions(max_new_tokens=4), n_samples_per_prompt=2,
    )


@pytest.fixture(scope="module")
async def servers(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    running = [await start_generator(GeneratorSettings(port=0, max_model_len=256), engine) for _ in range(2)]
    yield [f"127.0.0.1:{server.port}" for server in running]
    for server in running:
        await server.stop(1)


async def test_replicas_join_and_drain_as_the_name_resolves(servers):
    a, b = servers
    resolver = Resolver()
    fleet = GeneratorFleet(["dns:///generators:50051"], _connect, FAST, resolve=resolver)
    members = fleet.members
    try:
        resolver.answer = [a]
        await members.discover()
        await _until(lambda: [r.state for r in fleet.replicas] == [ReplicaState.SERVING], "a serving")

        resolver.answer = [a, b]
        await members.discover()
        await _until(lambda: all(r.state is ReplicaState.SERVING for r in fleet.replicas) and len(fleet.replicas) == 2,
                     "b joined")
        records = [r async for r in _completions(fleet, _request(4), Deadline())]
        assert sorted((r.prompt_index, r.sample_index) for r in records) == [(p, s) for p in range(4) for s in range(2)]

        # requests with one affinity key (an episode's turns) stay on the replica that holds their prefix: the first
        # turn goes to b while a looks busy; the later ones go back to b although a would win a tie by name
        first, second = fleet.replicas

        def turn(k: int) -> GenerationRequest:  # the episode's sequence grows with each turn: a new prompt each time
            return dataclasses.replace(_request(1), prompts=((100, 101, 102, *range(200, 200 + 5 * k)),),
                                       affinity_key="episode-7")

        first.outstanding_tokens += 10**6
        assert len([r async for r in _completions(fleet, turn(0), Deadline())]) == 2
        first.outstanding_tokens -= 10**6
        for k in (1, 2):
            assert len([r async for r in _completions(fleet, turn(k), Deadline())]) == 2
        assert [r.address for r in fleet.replicas if r.warm("episode-7/0")] == [second.address]
        assert first.in_flight_samples == second.in_flight_samples == 0

        resolver.answer = OSError("name resolution failed")  # a DNS hiccup keeps both
        await members.discover()
        assert len(fleet.replicas) == 2 and "name resolution failed" not in members.describe()

        resolver.answer = [b]  # a's pod went away: drained, then closed and forgotten
        await members.discover()
        assert members.describe().count("draining") == 1
        records = [r async for r in _completions(fleet, _request(3), Deadline())]
        assert len(records) == 6
        await _until(lambda: [r.address for r in fleet.replicas] == [b], "a closed once idle")

        resolver.answer = [a, b]  # and back
        await members.discover()
        await _until(lambda: len(fleet.replicas) == 2 and all(fleet.members.routable(r) for r in fleet.replicas),
                     "a back")
    finally:
        await fleet.close()


async def test_dns_targets_resolve_to_every_address_and_plain_ones_pass_through():
    addresses = await resolve_targets(["dns:///localhost:50051", "generator-0.example:7"])
    assert "127.0.0.1:50051" in addresses
    assert "generator-0.example:7" in addresses
    with pytest.raises(ValueError, match="dns:///name:port"):
        await resolve_targets(["dns:///no-port"])

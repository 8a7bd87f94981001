"""A stream's window leases (services.experience.pipeline.window) end however the stream ends. A trainer that takes
a batch, hangs, and has its call cancelled while groups are generating gives back every lease and the fleet's
load, so the next stream runs. On a real generator server (HF engine, tiny Llama) behind the real fleet, capped at
one group in flight (``max_samples_in_flight`` = n), so load a cancelled stream kept would stall every later one."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from fastexp.rl.advantages import get_estimator
from fastexp.sampling import SamplingOptions
from services.common.channels import open_channel
from services.common.deadlines import Deadline
from services.experience.config import ExperienceConfig, ExperienceRequest, PromptSpec
from services.experience.fleet.clients import GeneratorClient
from services.experience.fleet.generator_fleet import GeneratorFleet
from services.experience.fleet.replicas import FleetSettings
from services.experience.pipeline.events import ScoredGroup
from services.experience.pipeline.maker import ExperienceMaker, ForwardModels
from services.experience.pipeline.producer import Producer
from services.experience.pipeline.rollouts import RolloutParts
from services.experience.pipeline.versions import PolicyClocks
from services.experience.workers.logprobs import LogProbModel
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from tests.support.inprocess import InProcessRuleScorer

N = 2


@pytest.fixture(scope="module")
async def fleet(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)
    server = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    address = f"127.0.0.1:{server.port}"
    fleet = GeneratorFleet([address], lambda a: GeneratorClient(open_channel(a, 64 * 2**20), 60, 60, a),
                           FleetSettings(max_samples_in_flight=N))
    watching = asyncio.create_task(fleet.run())
    async with asyncio.timeout(120):
        await fleet.members.wait_routable()  # probed and serving
    yield fleet
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    await fleet.close()
    await server.stop(1)


@pytest.fixture(scope="module")
def models(tiny_model_path):
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    return ForwardModels(model, model, None, micro_batch_size=4)


def _request(name: str, count: int) -> ExperienceRequest:
    prompts = tuple(PromptSpec(f"{name}{i}", (100 + i, 101, 102), "1", "") for i in range(count))
    config = ExperienceConfig(N, get_estimator("rloo"), micro_rollout_batch_size=N)  # one group per batch
    return ExperienceRequest(name, prompts, SamplingOptions(max_new_tokens=4), config)


async def _fleet_idle(fleet: GeneratorFleet) -> None:
    """Return once no replica holds load for any stream (waits on the replica set's changes, not on time)."""
    try:
        async with asyncio.timeout(60):
            await fleet.members.changes.wait_until(
                lambda: all(not r.streams and r.in_flight_samples == 0 and r.outstanding_tokens == 0
                            for r in fleet.replicas))
    except TimeoutError:
        kept = [(r.address, len(r.streams), r.in_flight_samples, r.outstanding_tokens) for r in fleet.replicas]
        raise AssertionError(f"load kept (replica, streams, samples, tokens): {kept}") from None


class Announcing:
    """The real fleet, announcing each generation request once its first item came back (it is mid-flight then)."""

    def __init__(self, fleet: GeneratorFleet) -> None:
        self._fleet = fleet
        self.started: asyncio.Queue[str] = asyncio.Queue()

    async def generate(self, request, deadline):
        announced = False
        async with contextlib.aclosing(self._fleet.generate(request, deadline)) as items:
            async for item in items:
                if not announced:
                    announced = True
                    self.started.put_nowait(request.request_id)
                yield item


async def test_closing_a_stream_mid_flight_ends_every_lease_exactly_once(fleet):
    run = Producer(RolloutParts(fleet, InProcessRuleScorer()), PolicyClocks(), max_groups_ahead=2).start(
        _request("closed", 6), Deadline.from_remaining(120)
    )
    async with asyncio.timeout(60):
        while not isinstance(first := await run.events.get(), ScoredGroup):
            pass
    assert run.window.held == {0, 1}  # nothing streamed: the window is full, prompt 1 is generating or scored
    await run.close()  # what the consumer does however its stream ends
    assert run.window.held == frozenset()
    assert run.window.end([first.prompt_index, 1]) == 0  # ended once: a late end changes nothing
    await _fleet_idle(fleet)


async def test_a_hung_trainers_cancelled_stream_gives_its_slots_back_and_the_next_stream_runs(fleet, models):
    generator = Announcing(fleet)
    maker = ExperienceMaker(generator, InProcessRuleScorer(), models, pad_token_id=2, max_groups_ahead=2)
    stream = maker.make_experiences(_request("hung", 6), Deadline())
    async with asyncio.timeout(120):
        first = await anext(stream)  # groups 0 and 1 hold the window's two slots
        first_round = await generator.started.get()
        second = await anext(stream)  # asking for it ended group 0's lease: prompt 2 goes to the generator
        assert await generator.started.get() != first_round  # prompt 2 is generating; the trainer hangs now
    assert (first.prompt_index, second.prompt_index) == ((0,) * N, (1,) * N)
    await stream.aclose()  # its call is cancelled (as a server handler blocked writing to a hung trainer is)
    await _fleet_idle(fleet)

    prompts = []
    async with asyncio.timeout(300):  # a slot or load kept by the cancelled stream would stall this one
        async for experience in maker.make_experiences(_request("next", 3), Deadline()):
            prompts.extend(experience.prompt_index)
    assert sorted(prompts) == [p for p in range(3) for _ in range(N)]

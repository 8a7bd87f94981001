"""Weighted fair share of the generator on the real services: with the fleet's capacity full of one run's groups, a
second run's groups go before the first run's queued ones (it holds nothing), so a small run is never starved
behind a big one, and both streams finish. SmolLM2 (HF backend), one group of two samples in flight per run."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from fastexp.request import build_request
from fastexp.sampling import SamplingOptions
from fastexp.v1 import experience_pb2
from tests.support.stack import three_services

pytestmark = [pytest.mark.smollm2]

BIG, SMALL = 10, 2  # prompt groups of each run


@pytest.fixture(scope="module")
async def stack(smollm2_path):
    async with three_services(smollm2_path, experience={"max_samples_in_flight": 2}) as running:
        yield running


def _request(run_id: str, prompts: int):
    return build_request([f"Count from {i} to {i + 20}:" for i in range(prompts)], n_samples_per_prompt=2,
                         advantage_estimator="rloo", run_id=run_id,
                         sampling=SamplingOptions(temperature=1.0, max_new_tokens=12))


async def test_a_small_run_is_not_starved_behind_a_big_one(stack):
    arrivals: list[str] = []  # the run of each batch, in arrival order (both streams read as batches come)

    async def read(call, run: str) -> None:
        while await call.read() is not grpc.aio.EOF:
            arrivals.append(run)

    await stack.experience_stub.CreateRun(experience_pb2.CreateRunRequest(run_id="big"), timeout=30)
    big = stack.experience_stub.MakeExperiences(_request("big", BIG), timeout=600)
    await big.read()  # the big run generates: its other groups wait for the capacity (one group at a time)
    arrivals.append("big")
    run = await stack.experience_stub.GetRun(experience_pb2.GetRunRequest(run_id="big"), timeout=30)
    assert run.groups_in_flight == 1 and run.groups_queued >= 1
    small = stack.experience_stub.MakeExperiences(_request("small", SMALL), timeout=600)
    await asyncio.gather(read(big, "big"), read(small, "small"))
    assert arrivals.count("big") == BIG and arrivals.count("small") == SMALL
    # first come, first served would put both small groups after all of big's; fair share puts them next
    big_before_small_ended = arrivals[: len(arrivals) - arrivals[::-1].index("small")].count("big")
    assert big_before_small_ended <= 4, arrivals

"""FIRE sampling on the HF backend (tiny Llama): only the first response token is sampled at
``first_token_temperature``; bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from services.generator.hf_engine import HFEngine
from tests.support.fire import HOT, assert_only_the_first_token_is_hot, fire_request
from tests.support.inprocess import serving_generator


@pytest.fixture(scope="module")
async def stub(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=16)
    async with serving_generator(engine, 256) as (stub, _):
        yield stub


async def completions(stub, request):
    return [c async for r in stub.Generate(request, timeout=60) for c in r.completions]


async def test_fire_changes_only_the_first_tokens_temperature(stub):
    assert_only_the_first_token_is_hot(
        with_fire=await completions(stub, fire_request(HOT)), without_fire=await completions(stub, fire_request(None))
    )


@pytest.mark.parametrize(("temperature", "first", "message"), [
    (1.0, 0.0, "must be finite and > 0"),
    (1.0, float("nan"), "must be finite and > 0"),
    (0.0, 2.0, "needs temperature > 0"),
])
async def test_bad_first_token_temperature_is_invalid_argument(stub, temperature, first, message):
    request = fire_request(first)
    request.sampling.temperature = temperature
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await completions(stub, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.first_token_temperature" in error.value.details() and message in error.value.details()

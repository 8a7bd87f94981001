"""FIRE sampling on the HF backend (tiny Llama): only the first response token is sampled at
``first_token_temperature``; bad values are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import pytest

from fastexp.v1 import generation_pb2_grpc
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from tests.support.fire import HOT, assert_only_the_first_token_is_hot, fire_request


@pytest.fixture(scope="module")
async def stub(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=16)
    running = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    await channel.close()
    await running.stop(1)
    await engine.close()


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

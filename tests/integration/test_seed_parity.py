"""Seed (LightRFT) behaviours a migrating run relies on, through the real services in process (HF backend):
``ignore_eos`` and the ``skip_special_tokens`` default on SmolLM2 (a model that really ends its answers with EOS).
The vLLM side of both is in ``tests/e2e/test_smollm2.py``."""

from __future__ import annotations

import grpc
import pytest

from fastexp import Sampling
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings

pytestmark = pytest.mark.smollm2

SAY_HI = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
async def smollm2_generator(smollm2_path):
    engine = HFEngine.start(smollm2_path, dtype="bfloat16", max_model_len=512, max_batch_size=4)
    running = await start_generator(GeneratorSettings(port=0, max_model_len=512), engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    await channel.close()
    await running.stop(1)
    await engine.close()


async def _generate(stub, sampling: Sampling) -> list[generation_pb2.Completion]:
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text=SAY_HI)], sampling=sampling.to_pb(), n_samples_per_prompt=2)
    return [c async for r in stub.Generate(request, timeout=120) for c in r.completions]


async def test_ignore_eos_samples_past_eos_to_max_new_tokens(smollm2_generator):
    eos = (await smollm2_generator.GetModelInfo(generation_pb2.GetModelInfoRequest())).eos_token_id
    stopped = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=40))
    assert all(c.finish_reason == generation_pb2.FINISH_REASON_STOP for c in stopped)
    assert all(c.output_token_ids[-1] == eos and len(c.output_token_ids) < 40 for c in stopped)
    ignored = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=40, ignore_eos=True))
    for before, after in zip(stopped, ignored, strict=True):
        assert after.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(after.output_token_ids) == 40
        # greedy: the same answer up to and with EOS, then the model goes on
        assert list(after.output_token_ids[: len(before.output_token_ids)]) == list(before.output_token_ids)
        assert len(after.output_log_probs.data) == 4 * 40


async def test_skip_special_tokens_defaults_to_false_as_in_the_seed(smollm2_generator):
    assert Sampling().skip_special_tokens is False and generation_pb2.SamplingParams().skip_special_tokens is False
    kept = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=40))
    assert all(c.text.endswith("<|im_end|>") for c in kept)  # what reward models and rule functions see
    skipped = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=40, skip_special_tokens=True))
    assert [c.text + "<|im_end|>" for c in skipped] == [c.text for c in kept]

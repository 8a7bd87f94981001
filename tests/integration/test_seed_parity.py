"""Seed (LightRFT) behaviours a migrating run relies on, through the real generator service in process (HF backend)
on SmolLM2 (a model that really ends its answers with EOS): ``ignore_eos``, the ``skip_special_tokens`` default,
and sleeping to free memory for a colocated trainer. The vLLM side is in ``tests/e2e/test_smollm2.py`` (sampling)
and ``tests/e2e/test_vllm_tiny.py`` (sleep mode refused on vLLM's CPU build)."""

from __future__ import annotations

import grpc
import pytest

from fastexp import Sampling, weight_chunks
from fastexp.v1 import generation_pb2
from fastexp.wire import sampling_to_pb
from services.generator.hf_engine import HFEngine
from tests.support.inprocess import serving_generator

pytestmark = pytest.mark.smollm2

SAY_HI = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
MAX = 48  # new tokens: room past the greedy answer's EOS


@pytest.fixture(scope="module", params=["float32"])
async def smollm2_generator(request, smollm2_path):
    """float32 for the sampling tests: greedy bf16 depends on the CPU's bf16 arithmetic (on a CPU without native
    bf16 SmolLM2 greedily loops past 60 tokens without EOS; in float32 it ends "Say hi." at 33 tokens). The sleep
    test asks for bf16 (its memory figures are the bf16 model's)."""
    engine = HFEngine.start(smollm2_path, dtype=request.param, max_model_len=512, max_batch_size=4)
    async with serving_generator(engine, 512, checkpoint_roots=[smollm2_path]) as (stub, _):
        yield stub


async def _generate(stub, sampling: Sampling) -> list[generation_pb2.Completion]:
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text=SAY_HI)], sampling=sampling_to_pb(sampling), n_samples_per_prompt=2)
    return [c async for r in stub.Generate(request, timeout=120) for c in r.completions]


async def test_ignore_eos_samples_past_eos_to_max_new_tokens(smollm2_generator):
    eos = (await smollm2_generator.GetModelInfo(generation_pb2.GetModelInfoRequest())).eos_token_id
    stopped = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=MAX))
    assert all(c.finish_reason == generation_pb2.FINISH_REASON_STOP for c in stopped)
    assert all(c.output_token_ids[-1] == eos and len(c.output_token_ids) < MAX for c in stopped)
    ignored = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=MAX, ignore_eos=True))
    for before, after in zip(stopped, ignored, strict=True):
        assert after.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(after.output_token_ids) == MAX
        # greedy: the same answer up to and with EOS, then the model goes on
        assert list(after.output_token_ids[: len(before.output_token_ids)]) == list(before.output_token_ids)
        assert len(after.output_log_probs.data) == 4 * MAX


async def test_skip_special_tokens_defaults_to_false_as_in_the_seed(smollm2_generator):
    assert Sampling().skip_special_tokens is False and generation_pb2.SamplingParams().skip_special_tokens is False
    kept = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=MAX))
    assert all(c.text.endswith("<|im_end|>") for c in kept)  # what reward models and rule functions see
    skipped = await _generate(smollm2_generator, Sampling(temperature=0.0, max_new_tokens=MAX, skip_special_tokens=True))
    assert [c.text + "<|im_end|>" for c in skipped] == [c.text for c in kept]


@pytest.mark.parametrize("smollm2_generator", ["bfloat16"], indirect=True)
async def test_sleep_level_2_frees_the_weights_and_a_full_update_brings_generation_back(smollm2_generator,
                                                                                        smollm2_path):
    """The seed's enable_engine_sleep on the HF backend: level 1 has nothing to move on a CPU engine (refused,
    saying so); level 2 drops the weights (host memory measured), gates Generate and UpdateWeights, and after
    WakeUp a full update (the checkpoint folder) makes it sample exactly as before."""
    import psutil

    stub, process = smollm2_generator, psutil.Process()
    before = await _generate(stub, Sampling(temperature=0.0, max_new_tokens=16))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Sleep(generation_pb2.SleepRequest(level=1))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "host memory" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Sleep(generation_pb2.SleepRequest(level=3))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "level" in info.value.details()
    rss_awake = process.memory_info().rss
    response = await stub.Sleep(generation_pb2.SleepRequest(level=2))
    rss_asleep = process.memory_info().rss
    assert response.freed_bytes > 250 * 2**20  # SmolLM2-135M in bf16: 2 bytes x 134.5M parameters
    assert rss_awake - rss_asleep > 0.5 * response.freed_bytes, (rss_awake, rss_asleep)
    info_asleep = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info_asleep.sleep_level == 2
    for call in (_generate(stub, Sampling(max_new_tokens=4)), stub.Sleep(generation_pb2.SleepRequest(level=2)),
                 stub.UpdateWeights(iter(weight_chunks((), checkpoint_dir=smollm2_path)))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "asleep" in info.value.details()
    woken = await stub.WakeUp(generation_pb2.WakeUpRequest())
    assert woken.needs_weights and woken.policy_version == info_asleep.policy_version
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _generate(stub, Sampling(max_new_tokens=4))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "every tensor" in info.value.details()
    embed = "model.embed_tokens.weight"
    from safetensors import safe_open

    with safe_open(f"{smollm2_path}/model.safetensors", "pt") as checkpoint:
        partial = [(embed, checkpoint.get_tensor(embed))]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(iter(weight_chunks(partial)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "must carry every tensor" in info.value.details()
    full = await stub.UpdateWeights(iter(weight_chunks((), checkpoint_dir=smollm2_path)))
    assert full.policy_version == info_asleep.policy_version + 1
    after = await _generate(stub, Sampling(temperature=0.0, max_new_tokens=16))
    assert [list(c.output_token_ids) for c in after] == [list(c.output_token_ids) for c in before]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.WakeUp(generation_pb2.WakeUpRequest())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "awake" in info.value.details()

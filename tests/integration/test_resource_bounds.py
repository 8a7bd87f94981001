"""Resource bounds (issue 30, part 5) through the real services in process on port 0 (HF tiny Llama, float32;
math-verify scorer): the per-request token cap, weight updates checked on each tensor's first chunk, and
``checkpoint_dir`` only under ``checkpoint_roots``. One stack for the module."""

from __future__ import annotations

import asyncio
import shutil
import zlib
from pathlib import Path

import grpc
import pytest
import torch

from fastexp import Sampling, build_request, weight_chunks
from fastexp.v1 import generation_pb2, tensor_pb2
from services.common.weights import TensorSpec, WeightStager, max_update_bytes
from tests.support.stack import MATH_VERIFY_OR_ZERO, three_services

TOKEN_CAP = 1000  # prompts x samples x max_new_tokens


@pytest.fixture(scope="module")
def roots(tmp_path_factory, tiny_model_path) -> dict[str, Path]:
    """A checkpoint root holding a copy of the model, a symlink out of it, and the model's own folder outside."""
    root = tmp_path_factory.mktemp("checkpoints")
    shutil.copytree(tiny_model_path, root / "good")
    (root / "escape").symlink_to(tiny_model_path, target_is_directory=True)
    return {"root": root, "good": root / "good", "escape": root / "escape", "outside": Path(tiny_model_path)}


@pytest.fixture(scope="module")
async def stack(tiny_model_path, roots):
    bounds = {"max_tokens_per_request": TOKEN_CAP, "checkpoint_roots": [roots["root"]]}
    async with three_services(tiny_model_path, generator=bounds, scorer={"sources": [MATH_VERIFY_OR_ZERO]},
                              experience=bounds) as running:
        yield {"experience": running.experience_stub, "generator": running.generator_stub}


async def _greedy(generator) -> list[int]:
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="Count: one, two,")], n_samples_per_prompt=1,
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=6))
    return [t async for r in generator.Generate(request, timeout=60) for c in r.completions for t in c.output_token_ids]


async def _version(generator) -> int:
    return (await generator.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)).policy_version


# -- a. prompts x samples x max_new_tokens -------------------------------------------------------------------------


async def test_a_request_over_the_token_cap_is_resource_exhausted_naming_it(stack):
    over = build_request(["What is 2 + 3?"] * 4, n_samples_per_prompt=4, sampling=Sampling(max_new_tokens=100))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in stack["experience"].MakeExperiences(over, timeout=60)]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details().startswith("max_tokens_per_request: 4 prompts x 4 n_samples_per_prompt x 100")
    direct = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="hi")] * 4, n_samples_per_prompt=4,
        sampling=generation_pb2.SamplingParams(max_new_tokens=100))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in stack["generator"].Generate(direct, timeout=60)]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokens_per_request" in caught.value.details()


async def test_a_request_under_the_token_cap_streams(stack):
    under = build_request(["What is 2 + 3?"] * 2, n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=8))
    batches = [m async for m in stack["experience"].MakeExperiences(under, timeout=300)]
    assert sum(len(b.prompt_index) for b in batches) == 4


# -- c. weight updates ---------------------------------------------------------------------------------------------


def _chunk(name, shape, data, dtype=tensor_pb2.DTYPE_FLOAT32, crc32=True):
    return generation_pb2.WeightsChunk(tensor=generation_pb2.TensorChunk(
        name=name, dtype=dtype, shape=shape, data=data, crc32=zlib.crc32(data) if crc32 else None))


NORM = "model.norm.weight"  # (64,) float32 in the tiny Llama
GOOD = torch.full((64,), 3.0).numpy().tobytes()
FIRST_CHUNK_CASES = {
    "unknown name": (_chunk("model.no_such.weight", [1 << 20], b"\0" * 4096), "tensors[model.no_such.weight]: the "
                     "model has no tensor"),
    "wrong shape": (_chunk(NORM, [1 << 20], b"\0" * 4096), f"tensors[{NORM}]: shape [1048576] != the model's [64]"),
    "wider dtype": (_chunk(NORM, [64], b"\0" * 256, tensor_pb2.DTYPE_FLOAT64), f"tensors[{NORM}]: dtype float64 is "
                    "wider"),
    "no checksum": (_chunk(NORM, [64], GOOD[:128], crc32=False), f"tensors[{NORM}]: the first chunk must carry crc32"),
}


@pytest.mark.parametrize("service", ["generator", "experience"])
@pytest.mark.parametrize("case", sorted(FIRST_CHUNK_CASES))
async def test_a_bad_tensor_is_refused_on_its_first_chunk_while_the_stream_is_still_open(stack, service, case):
    """The answer comes before the sender finished (or even closed) its stream: nothing after the first chunk of
    the bad tensor was waited for or buffered."""
    chunk, expected = FIRST_CHUNK_CASES[case]
    call = stack[service].UpdateWeights(timeout=30)
    await call.write(generation_pb2.WeightsChunk(header=generation_pb2.WeightsHeader()))
    await call.write(chunk)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call, 15)  # no done_writing(): the stream stays open
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in caught.value.details(), caught.value.details()


@pytest.mark.parametrize("service", ["generator", "experience"])
async def test_a_tensor_sent_twice_or_corrupted_is_refused_and_nothing_is_applied(stack, service):
    before, version = await _greedy(stack["generator"]), await _version(stack["generator"])
    bias = "model.layers.0.input_layernorm.weight"
    twice = [generation_pb2.WeightsChunk(header=generation_pb2.WeightsHeader()), _chunk(NORM, [64], GOOD),
             _chunk(bias, [64], GOOD), _chunk(NORM, [64], GOOD)]
    corrupted = [twice[0], _chunk(NORM, [64], GOOD), generation_pb2.WeightsChunk(tensor=generation_pb2.TensorChunk(
        name=bias, dtype=tensor_pb2.DTYPE_FLOAT32, shape=[64], data=GOOD, crc32=zlib.crc32(GOOD) ^ 1))]
    for messages, expected in ((twice, f"tensors[{NORM}]: sent twice"), (corrupted, f"tensors[{bias}]: CRC-32")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack[service].UpdateWeights(iter(messages), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in caught.value.details()
    assert await _version(stack["generator"]) == version
    assert await _greedy(stack["generator"]) == before  # model.norm.weight (valid, sent first) was not applied


def test_the_stager_writes_nothing_of_a_refused_tensor_and_caps_the_update_at_the_models_size(tmp_path):
    spec = {"a": TensorSpec((2, 3), "bfloat16"), "b": TensorSpec((4,), "float64")}
    assert max_update_bytes(spec) == 6 * 4 + 4 * 8  # float32 accepted for a bf16 tensor; float64 for a float64 one
    stager = WeightStager(tmp_path)
    try:
        stager.expect(spec)
        with pytest.raises(Exception, match=r"tensors\[a\]: shape \[3, 2\]"):
            stager.add("a", "float32", (3, 2), b"\0" * 24, 0)
        assert list(stager.folder.iterdir()) == []  # refused before its file was opened
    finally:
        stager.discard()


# -- d. checkpoint_dir under checkpoint_roots ----------------------------------------------------------------------


@pytest.mark.parametrize("service", ["generator", "experience"])
async def test_checkpoint_dir_outside_the_roots_is_refused_naming_the_field(stack, roots, service):
    version = await _version(stack["generator"])
    dotdot = f"{roots['root']}/../{roots['outside'].name}"
    for folder in (str(roots["outside"]), dotdot, str(roots["escape"]), "relative/folder", "/etc"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack[service].UpdateWeights(iter(weight_chunks((), checkpoint_dir=folder)), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, folder
        assert caught.value.details().startswith("header.checkpoint_dir: "), caught.value.details()
    assert await _version(stack["generator"]) == version


@pytest.mark.parametrize("service", ["generator", "experience"])
async def test_checkpoint_dir_under_a_root_is_applied(stack, roots, service):
    reply = await stack[service].UpdateWeights(iter(weight_chunks((), checkpoint_dir=str(roots["good"]))), timeout=60)
    assert reply.num_tensors == 20  # the tiny Llama's tensors, read from the copy under the root
    assert reply.policy_version == await _version(stack["generator"])  # live on the generator

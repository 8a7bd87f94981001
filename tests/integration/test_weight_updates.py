"""UpdateWeights on the generator (HF backend, tiny Llama, float32): streamed and folder updates change sampling
exactly as predicted, versions tag completions, and a bad update is rejected as a whole."""

from __future__ import annotations

import asyncio
import logging
import os
import zlib

import grpc
import pytest
import torch

from fastexp import update_generator_weights, weight_chunks
from fastexp.tensor_codec import to_numpy
from fastexp.v1 import experience_pb2, experience_pb2_grpc, generation_pb2, tensor_pb2
from services.common.metrics import GRPC_HANDLED
from services.generator.hf_engine import HFEngine
from tests.support.inprocess import serving_generator

PROMPT = "Count: one, two,"


@pytest.fixture(scope="module")
async def generator(tiny_model_path, tmp_path_factory):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    roots = [tmp_path_factory.getbasetemp()]  # each test's tmp_path is under it
    async with serving_generator(engine, 256, checkpoint_roots=roots) as (stub, address):
        yield {"stub": stub, "address": address, "engine": engine}


def perturbed(model_path: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=g))
    return model


async def sample(stub) -> generation_pb2.Completion:
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text=PROMPT)], n_samples_per_prompt=1,
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
    )
    return [c async for r in stub.Generate(request, timeout=60) for c in r.completions][0]


def forward_log_probs(model, completion) -> torch.Tensor:
    """log π(o_t | prefix) of the sampled tokens under ``model`` (a plain forward pass)."""
    prompt, output = list(completion.prompt_token_ids), list(completion.output_token_ids)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def assert_sampled_by(model, completion):
    sampled = torch.tensor(to_numpy(completion.output_log_probs))
    torch.testing.assert_close(sampled, forward_log_probs(model, completion), atol=1e-4, rtol=0)


async def test_streamed_then_folder_updates_change_sampling_as_predicted(generator, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    stub = generator["stub"]
    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    before = await sample(stub)
    assert before.policy_version == 0
    assert_sampled_by(original, before)

    first = perturbed(tiny_model_path, seed=1)
    tensors = list(first.state_dict().items())
    version = await asyncio.to_thread(update_generator_weights, generator["address"], tensors, chunk_bytes=4096)
    assert version == 1
    after = await sample(stub)
    assert after.policy_version == 1
    assert_sampled_by(first, after)  # the update is live: sampling follows the perturbed weights
    with pytest.raises(AssertionError):
        assert_sampled_by(original, after)  # ... and no longer the old ones

    second = perturbed(tiny_model_path, seed=2)
    second.save_pretrained(tmp_path)
    version = await asyncio.to_thread(update_generator_weights, generator["address"], checkpoint_dir=str(tmp_path))
    assert version == 2
    latest = await sample(stub)
    assert latest.policy_version == 2
    assert_sampled_by(second, latest)
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert info.policy_version == 2


def _chunk(name, shape, data, dtype=tensor_pb2.DTYPE_FLOAT32, crc32=True):
    """One tensor's (first) chunk; ``crc32``: carry the CRC-32 of ``data``, as every first chunk must."""
    return generation_pb2.WeightsChunk(tensor=generation_pb2.TensorChunk(
        name=name, dtype=dtype, shape=shape, data=data, crc32=zlib.crc32(data) if crc32 else None))


def _header(**fields):
    return generation_pb2.WeightsChunk(header=generation_pb2.WeightsHeader(**fields))


async def test_a_bad_update_is_rejected_as_a_whole_and_the_old_weights_stay_live(generator, tiny_model_path):
    stub = generator["stub"]
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    live_before = await sample(stub)
    good_name = "model.norm.weight"
    good = torch.full((64,), 3.0).numpy().tobytes()
    cases = {
        "unknown name": ([_header(), _chunk(good_name, [64], good), _chunk("model.no_such.weight", [2], b"\0" * 8)],
                         "tensors[model.no_such.weight]: the model has no tensor"),
        "wrong shape": ([_header(), _chunk(good_name, [64], good), _chunk("lm_head.weight", [3, 2], b"\0" * 24)],
                        "tensors[lm_head.weight]: shape [3, 2]"),
        "integer dtype": ([_header(), _chunk(good_name, [64], b"\0" * 512, tensor_pb2.DTYPE_INT64)],
                          "tensors[model.norm.weight]: dtype int64 is not a floating-point type"),
        "incomplete": ([_header(), _chunk(good_name, [64], good[:100])], "100 of 256 bytes arrived"),
        "too many bytes": ([_header(), _chunk(good_name, [64], good + b"\0\0\0\0")], "more than the 256 bytes"),
        "count mismatch": ([_header(num_tensors=2), _chunk(good_name, [64], good)], "2 announced, 1 arrived"),
        "missing folder": ([_header(checkpoint_dir="/no/such/checkpoint")], "checkpoint_dir: '/no/such/checkpoint'"),
        "no header": ([_chunk(good_name, [64], good)], "header: the first message must carry the header"),
    }
    for case, (messages, expected) in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.UpdateWeights(iter(messages), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert expected in caught.value.details(), (case, caught.value.details())
    after = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert after.policy_version == info.policy_version
    # model.norm.weight (sent first, valid) was not applied: sampling is unchanged
    live_after = await sample(stub)
    assert list(live_after.output_token_ids) == list(live_before.output_token_ids)
    assert to_numpy(live_after.output_log_probs).tolist() == to_numpy(live_before.output_log_probs).tolist()


def test_weight_chunks_split_tensors_and_keep_bytes():
    tensors = [("a", torch.arange(10, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    messages = list(weight_chunks(tensors, chunk_bytes=16))
    assert messages[0].header.num_tensors == 2
    a_parts = [m.tensor for m in messages[1:] if m.tensor.name == "a"]
    assert [len(p.data) for p in a_parts] == [16, 16, 8] and all(list(p.shape) == [10] for p in a_parts)
    assert b"".join(p.data for p in a_parts) == tensors[0][1].numpy().tobytes()
    b_parts = [m.tensor for m in messages[1:] if m.tensor.name == "b"]
    assert b_parts[0].dtype == tensor_pb2.DTYPE_BFLOAT16 and len(b_parts[0].data) == 6
    with pytest.raises(ValueError, match="not a floating-point"):
        list(weight_chunks([("i", torch.ones(2, dtype=torch.int64))]))


def test_weight_chunks_batch_whole_small_tensors_in_order_and_chunk_large_ones():
    tensors = [("a", torch.arange(3, dtype=torch.float32)), ("b", torch.ones(2, dtype=torch.bfloat16)),
               ("big", torch.arange(10, dtype=torch.float32)), ("c", torch.zeros(1))]
    messages = list(weight_chunks(tensors, chunk_bytes=16, batch=True))
    assert [m.WhichOneof("kind") for m in messages] == ["header", "tensors", "tensor", "tensor", "tensor", "tensors"]
    first, last = messages[1].tensors.tensors, messages[-1].tensors.tensors
    assert [t.name for t in first] == ["a", "b"] and [t.name for t in last] == ["c"]  # in order: 16 bytes fit one
    assert all(t.crc32 == zlib.crc32(t.data) for t in [*first, *last])  # each whole, with its CRC-32
    assert b"".join(m.tensor.data for m in messages[2:5]) == tensors[2][1].numpy().tobytes()


async def test_a_batched_update_applies_as_one_tensor_per_message_does(generator, tiny_model_path):
    stub = generator["stub"]
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert "tensor-batches" in info.features
    model = perturbed(tiny_model_path, seed=3)
    messages = list(weight_chunks(list(model.state_dict().items()), chunk_bytes=1 << 20, batch=True))
    assert any(m.WhichOneof("kind") == "tensors" for m in messages)
    answer = await stub.UpdateWeights(iter(messages), timeout=60)
    assert answer.policy_version == info.policy_version + 1
    assert_sampled_by(model, await sample(stub))
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # an empty message (or a kind from a newer sender)
        await stub.UpdateWeights(iter([_header(num_tensors=1), generation_pb2.WeightsChunk()]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("kind: ")


class _LogLine(logging.Handler):
    """Sets ``seen`` when a record containing ``text`` is logged (on the event loop's thread, as the services log)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.seen = text, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


async def test_an_update_whose_caller_goes_ends_whole_before_its_folder_and_lock_go(generator, tiny_model_path):
    stub, engine = generator["stub"], generator["engine"]
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    model = perturbed(tiny_model_path, seed=4)
    applying, release, interrupted, seen = asyncio.Event(), asyncio.Event(), asyncio.Event(), {}
    update_weights = engine.update_weights

    async def held(kind, folder, version=None):  # the real update, held once it has started until the test says
        seen["folder"] = folder
        applying.set()
        try:
            await release.wait()
        except asyncio.CancelledError:  # the caller's cancellation reached the update itself
            interrupted.set()
            raise
        return await update_weights(kind, folder, version)

    gone, tasks_log = _LogLine("goes on to its end"), logging.getLogger("services.common.tasks")
    tasks_log.addHandler(gone)
    level = tasks_log.level
    tasks_log.setLevel(logging.INFO)
    cancelled = GRPC_HANDLED.labels("fastexp.v1.GenerationService", "UpdateWeights", "CANCELLED")
    cancelled_before = cancelled._value.get()
    engine.update_weights = held
    try:
        call = stub.UpdateWeights(weight_chunks(list(model.state_dict().items()), chunk_bytes=1 << 20), timeout=60)
        await _within(applying.wait())
        call.cancel()
        waits = [asyncio.ensure_future(event.wait()) for event in (gone.seen, interrupted)]
        try:  # the service saw its caller go: it says so, or it interrupted the update
            async with asyncio.timeout(60):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        assert not interrupted.is_set()
        assert os.path.isdir(seen["folder"]) and os.listdir(seen["folder"])  # the update still reads its folder
        with pytest.raises(grpc.aio.AioRpcError) as second:  # and still holds the one-update-at-a-time lock
            await stub.UpdateWeights(iter([_header(num_tensors=0)]), timeout=30)
        assert second.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        async with asyncio.timeout(60):  # the handler ends (counted CANCELLED) once the update has
            while cancelled._value.get() == cancelled_before:
                await asyncio.sleep(0.01)  # polling for that count, not waiting for time to pass
    finally:
        engine.update_weights = update_weights
        tasks_log.removeHandler(gone)
        tasks_log.setLevel(level)
        release.set()
    assert not os.path.exists(seen["folder"])
    after = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert after.policy_version == info.policy_version + 1  # applied whole, though nobody was left to hear
    assert_sampled_by(model, await sample(stub))


async def _within(awaitable, seconds: float = 60.0):
    async with asyncio.timeout(seconds):
        return await awaitable


class _OlderExperienceServer(experience_pb2_grpc.ExperienceServiceServicer):
    """An experience server of the contract's first version (no GetServerInfo: UNIMPLEMENTED), or one listing
    ``features``; it records the kinds of the UpdateWeights messages it gets."""

    def __init__(self, features: tuple[str, ...] | None, policy_dtype: str = "") -> None:
        self.features, self.policy_dtype, self.kinds, self.dtypes, self.asked = features, policy_dtype, [], [], 0

    def UpdateWeights(self, request_iterator, context):  # noqa: N802 - gRPC method name
        messages = list(request_iterator)
        self.kinds = [message.WhichOneof("kind") for message in messages]
        self.dtypes = [tensor_pb2.DType.Name(m.tensor.dtype) for m in messages if m.WhichOneof("kind") == "tensor"]
        return generation_pb2.UpdateWeightsResponse(policy_version=1)

    def GetServerInfo(self, request, context):  # noqa: N802 - gRPC method name
        self.asked += 1
        if self.features is None:
            return super().GetServerInfo(request, context)  # the generated base: UNIMPLEMENTED
        return experience_pb2.ServerInfo(features=list(self.features), policy_dtype=self.policy_dtype)


@pytest.mark.parametrize(("features", "batched"), [(None, False), ((), False), (("tensor-batches",), True)])
def test_the_sdk_batches_small_tensors_only_for_a_server_that_lists_the_feature(features, batched):
    from concurrent import futures

    from fastexp import ExperienceClient

    servicer = _OlderExperienceServer(features)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    experience_pb2_grpc.add_ExperienceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with ExperienceClient(f"127.0.0.1:{port}") as client:
            tensors = [(f"t{i}", torch.ones(4)) for i in range(8)]
            assert client.update_weights(tensors).policy_version == 1
    finally:
        server.stop(0)
    assert servicer.kinds[0] == "header"
    assert set(servicer.kinds[1:]) == ({"tensors"} if batched else {"tensor"}), servicer.kinds


def test_the_sdk_sends_policy_tensors_in_the_policy_type_the_server_says_now():
    from concurrent import futures

    from fastexp import ExperienceClient

    servicer = _OlderExperienceServer((), policy_dtype="")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    experience_pb2_grpc.add_ExperienceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tensors = [("w", torch.ones(4)), ("h", torch.ones(2, dtype=torch.float16)), ("d", torch.ones(2, dtype=torch.float64))]
    try:
        with ExperienceClient(f"127.0.0.1:{port}") as client:
            client.update_weights(tensors)  # no type said (its generator not reached yet): each tensor's own
            assert servicer.dtypes == ["DTYPE_FLOAT32", "DTYPE_FLOAT16", "DTYPE_FLOAT64"]
            servicer.policy_dtype = "bfloat16"
            client.update_weights(tensors)  # asked again: wider ones narrowed, float16 (as wide) left as it is
            assert servicer.dtypes == ["DTYPE_BFLOAT16", "DTYPE_FLOAT16", "DTYPE_BFLOAT16"]
            client.update_weights(tensors, target="critic")  # the critic's own type is not the policy's
            assert servicer.dtypes == ["DTYPE_FLOAT32", "DTYPE_FLOAT16", "DTYPE_FLOAT64"]
            client.update_weights(tensors, in_policy_dtype=False)
            assert servicer.dtypes == ["DTYPE_FLOAT32", "DTYPE_FLOAT16", "DTYPE_FLOAT64"]
            assert servicer.asked == 2  # neither of those two asked: they narrow nothing
            servicer.policy_dtype = "float16"  # redeployed: asked again, and never narrowed to float16's range
            client.update_weights(tensors)
            assert servicer.dtypes == ["DTYPE_FLOAT32", "DTYPE_FLOAT16", "DTYPE_FLOAT64"] and servicer.asked == 3
    finally:
        server.stop(0)

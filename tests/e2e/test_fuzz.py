"""Property-based fuzzing of the gRPC API (hypothesis): over a thousand generated MakeExperiences requests (empty,
huge and unicode prompts, extreme sampling parameters, enormous n_samples_per_prompt, unknown estimators,
non-finite floats), malformed UpdateWeights streams and oversized messages get only OK, INVALID_ARGUMENT or
RESOURCE_EXHAUSTED with a message, never a crash or a hang, and the services are still SERVING afterwards.

The services run as processes (HF backend, the tiny Llama) with small limits, so the valid requests are cheap.
"""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fastexp.v1 import experience_pb2, experience_pb2_grpc, generation_pb2, generation_pb2_grpc, tensor_pb2
from fastexp.wire import experience_from_pb
from services.launcher import LocalCluster

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_MESSAGE_BYTES = 1024 * 1024
# `make fuzz` runs the longer variant: FASTEXP_FUZZ_EXAMPLES=20000, new random examples instead of CI's fixed ones
EXAMPLES = int(os.environ.get("FASTEXP_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 1000, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    limits = {"max_prompts_per_request": 3, "max_samples_per_prompt": 4, "max_new_tokens_limit": 8,
              "max_message_bytes": MAX_MESSAGE_BYTES}
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32", "max_model_len": 256, **limits},
        "experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                       "torch_threads": 1, **limits},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path_factory.mktemp("fuzz-logs")) as running:
        yield running


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.one_of(st.text(max_size=64), st.just(""), st.text(alphabet="\u0000\u200b\U0001f600é中", max_size=16))
prompts = st.builds(
    lambda kind, text, role, reference: experience_pb2.PromptInput(
        **({"text": text} if kind == "text" else
           {"chat": experience_pb2.Conversation(messages=[experience_pb2.ChatMessage(role=role, content=text)])}),
        **({"reference": reference} if reference is not None else {})),
    st.sampled_from(["text", "chat", "chat"]), texts, st.sampled_from(["user", "system", "assistant", "", "robot"]),
    st.none() | texts,
)
sampling = st.builds(
    generation_pb2.SamplingParams,
    temperature=st.none() | floats, top_p=st.none() | floats, top_k=st.none() | st.integers(-(2**31), 2**31 - 1),
    max_new_tokens=st.integers(0, 2**32 - 1) | st.integers(0, 10), min_new_tokens=st.integers(0, 2**32 - 1) | st.just(0),
    seed=st.none() | st.integers(0, 2**64 - 1), first_token_temperature=st.none() | floats,
)
requests = st.builds(
    lambda ps, s, n, micro, estimator, kl_coef, kl_estimator, gamma, lambd, packing: experience_pb2.MakeExperiencesRequest(
        prompts=ps, sampling=s, n_samples_per_prompt=n, micro_rollout_batch_size=micro, advantage_estimator=estimator,
        kl=experience_pb2.KLSettings(**({"kl_coef": kl_coef} if kl_coef is not None else {}), kl_estimator=kl_estimator),
        **({"gamma": gamma} if gamma is not None else {}), **({"lambd": lambd} if lambd is not None else {}),
        packing_samples=packing),
    st.lists(prompts, max_size=5), sampling, st.integers(0, 2**32 - 1) | st.integers(0, 5), st.integers(0, 2**32 - 1),
    st.sampled_from(["", "group_norm", "rloo", "reinforce", "reinforce_baseline", "dr_grpo", "gae", "cpgd"]) | texts,
    st.none() | floats, st.sampled_from(["", "k1", "k2", "k3"]) | texts, st.none() | floats, st.none() | floats,
    st.booleans(),
)


# Mostly sensible requests with one odd corner each, so that accepted ones (and the streams behind them) are fuzzed
# too, not only the validators.
plausible = st.builds(
    lambda ps, n, tokens, estimator, packing: experience_pb2.MakeExperiencesRequest(
        prompts=ps, n_samples_per_prompt=n, advantage_estimator=estimator, packing_samples=packing,
        sampling=generation_pb2.SamplingParams(max_new_tokens=tokens)),
    st.lists(prompts, min_size=1, max_size=3), st.integers(1, 4), st.integers(1, 8),
    st.sampled_from(["", "group_norm", "rloo", "reinforce", "reinforce_baseline", "dr_grpo"]), st.booleans(),
)


def _check(error: grpc.RpcError | None) -> None:
    if error is None:
        return
    assert error.code() in ALLOWED, (error.code(), error.details())
    assert error.details(), "a refusal says why"


@FUZZ
@given(request=st.one_of(requests, plausible))
def test_make_experiences_answers_every_generated_request_cleanly(cluster, request):
    with grpc.insecure_channel(cluster.address("experience"), options=[
            ("grpc.max_receive_message_length", 64 * MAX_MESSAGE_BYTES)]) as channel:
        stub = experience_pb2_grpc.ExperienceServiceStub(channel)
        try:
            for batch in stub.MakeExperiences(request, timeout=120):
                experience = experience_from_pb(batch)  # an accepted request streams well-formed experiences
                assert torch.isfinite(experience.advantages[experience.action_mask]).all()
            event("OK")
        except grpc.RpcError as error:
            event(error.code().name)
            _check(error)


chunks = st.one_of(
    st.builds(lambda d, n, t: generation_pb2.WeightsChunk(header=generation_pb2.WeightsHeader(
        checkpoint_dir=d, num_tensors=n, target=t)), texts, st.integers(0, 2**32 - 1), st.integers(0, 1)),
    st.builds(lambda name, dtype, shape, data: generation_pb2.WeightsChunk(tensor=generation_pb2.TensorChunk(
        name=name, dtype=dtype, shape=shape, data=data)),
        st.sampled_from(["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"]) | texts,
        st.integers(0, 12), st.lists(st.integers(-4, 2**40), max_size=4), st.binary(max_size=512)),
)


@settings(FUZZ, max_examples=max(300, EXAMPLES // 3))
@given(stream=st.lists(chunks, max_size=6))
def test_update_weights_refuses_malformed_streams_cleanly(cluster, stream):
    with grpc.insecure_channel(cluster.address("generator")) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            stub.UpdateWeights(iter(stream), timeout=60)
        except grpc.RpcError as error:
            _check(error)


def test_oversized_messages_are_refused_and_the_services_stay_healthy(cluster):
    huge = experience_pb2.MakeExperiencesRequest(
        prompts=[experience_pb2.PromptInput(text="x" * (2 * MAX_MESSAGE_BYTES))], n_samples_per_prompt=2)
    with grpc.insecure_channel(cluster.address("experience"), options=[
            ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(experience_pb2_grpc.ExperienceServiceStub(channel).MakeExperiences(huge, timeout=30))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big_tensor = generation_pb2.WeightsChunk(tensor=generation_pb2.TensorChunk(
        name="lm_head.weight", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1], data=b"\0" * (2 * MAX_MESSAGE_BYTES)))
    with grpc.insecure_channel(cluster.address("generator"), options=[
            ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            generation_pb2_grpc.GenerationServiceStub(channel).UpdateWeights(iter([big_tensor]), timeout=30)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for name in ("generator", "scorer", "experience"):
        with grpc.insecure_channel(cluster.address(name)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name

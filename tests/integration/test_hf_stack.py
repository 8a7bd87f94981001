"""The three services in process on port 0, HF backend on a tiny Llama, real math-verify scorer.

Float32 throughout, so the generator's sampled log-probs (HF ``generate``) and the experience service's actor
forward pass must agree: this checks that sequences, masks and positions line up.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from transformers import AutoTokenizer

from fastexp import Sampling, build_request, save_value_model, unpack_experience, weight_chunks
from fastexp.rl.advantages import ESTIMATORS, get_estimator
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.options import AdvantageOptions, KLOptions, RewardOptions
from fastexp.rl.rollout_correction import RolloutCorrectionOptions
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.tensor_codec import to_numpy
from fastexp.types import ForwardOutputs, Rollout
from fastexp.v1 import generation_pb2, scoring_pb2
from fastexp.wire import experience_from_pb
from services.experience.config import ExperienceConfig
from tests.support.stack import MATH_VERIFY_OR_ZERO, three_services

PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    "Plain text prompt: count to three.",
    [{"role": "user", "content": "Name a prime number."}],
]


@pytest.fixture(scope="module")
def critic_path(tiny_model_path, tmp_path_factory):
    """A critic as a trainer would save it: the tiny Llama's backbone and a random value head."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(3)
    head = torch.nn.Linear(backbone.config.hidden_size, 1)
    return str(save_value_model(backbone, head, tmp_path_factory.mktemp("critic")))


@pytest.fixture(scope="module")
async def stack(tiny_model_path, critic_path):
    async with three_services(
        tiny_model_path, generator={"checkpoint_roots": [tiny_model_path]},
        scorer={"sources": [MATH_VERIFY_OR_ZERO]},
        experience={"forward_micro_batch_size": 3, "critic_model": critic_path},
    ) as running:
        yield {"experience": running.experience_stub, "health": running.health, "generator": running.generator_stub,
               "scorer": running.scorer_stub}


async def _collect(stub, request):
    return [experience_from_pb(m) async for m in stub.MakeExperiences(request, timeout=300)]


def _rollout_of(e):
    return Rollout(e.sequences, e.attention_mask, e.action_mask, e.response_length, e.total_length, e.prompt_index,
                   e.sample_index, e.prompt_texts, e.response_texts, e.policy_version, e.rollout_log_probs)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
async def test_each_estimator_through_make_experiences_matches_the_pure_function(stack, estimator):
    n = 2
    request = build_request(PROMPTS[:2], n_samples_per_prompt=n, advantage_estimator=estimator, gamma=0.95,
                            lambd=0.9, kl_coef=0.02, sampling=Sampling(max_new_tokens=6, seed=2))
    batches = await _collect(stack["experience"], request)
    assert sorted(p for e in batches for p in e.prompt_index) == [0, 0, 1, 1]
    config = ExperienceConfig(n, get_estimator(estimator), gamma=0.95, lambd=0.9, kl=KLOptions(kl_coef=0.02))
    for e in batches:
        assert (e.values is not None) == (estimator == "gae")
        again, _ = estimate_experience(
            _rollout_of(e), e.reward, e.reward_metrics,
            ForwardOutputs(e.action_log_probs, e.base_action_log_probs, e.values), config,
            RunState(RunningMoments(), KLController(0.02)),
        )
        assert torch.allclose(again.advantages, e.advantages, atol=1e-6)
        assert torch.allclose(again.returns, e.returns, atol=1e-6)


async def test_every_option_through_make_experiences_and_reproducible_from_the_batch(stack):
    """gae with the critic, packed forwards and output, entropy, running norm and adaptive beta over one run_id
    across two requests, overlong penalty, clips and whitening: the trainer recomputes every number."""
    n, max_new_tokens = 2, 8
    options = dict(
        n_samples_per_prompt=n, micro_rollout_batch_size=4, advantage_estimator="gae", gamma=0.9, lambd=0.8,
        kl_coef=0.05, kl_estimator="k3", kl_target=0.01, kl_horizon=100, reward_running_norm=True,
        reward_running_norm_minus_mean=True, reward_clip=0.7, overlong_buffer_len=4,
        overlong_buffer_penalty_factor=0.5, advantages_norm=True, advantage_clip=1.5, run_id="run-a",
        return_action_entropy=True, packing_samples=True, return_packed=True, rollout_is="token",
        rollout_is_threshold=1.5, sampling=Sampling(max_new_tokens=max_new_tokens, min_new_tokens=1, seed=5),
    )
    state = RunState(RunningMoments(), KLController(0.05, 0.01, 100))
    config = ExperienceConfig(
        n, get_estimator("gae"), gamma=0.9, lambd=0.8,
        kl=KLOptions(kl_coef=0.05, kl_estimator="k3", kl_target=0.01, kl_horizon=100),
        reward=RewardOptions(True, True, 0.7, 4, 0.5, max_new_tokens),
        advantage=AdvantageOptions(True, 1.5), rollout_correction=RolloutCorrectionOptions("token", 1.5),
    )
    for request_number in range(2):  # the run's statistics carry over to the second request
        batches = await _collect(stack["experience"], build_request(PROMPTS[:2], **options))
        assert sorted(p for e in batches for p in e.prompt_index) == [0, 0, 1, 1]
        for packed in batches:
            assert packed.sequences.shape[0] == 1 and packed.packed_seq_lens is not None
            e = unpack_experience(packed, pad_token_id=2)
            mask = e.action_mask
            assert e.values is not None and e.action_entropy is not None
            assert torch.all(e.action_entropy[mask] > 0) and torch.all(e.values[~mask] == 0)
            # actor and generator agree on the sampled tokens in the packed layout as well
            assert torch.allclose(e.action_log_probs[mask], e.rollout_log_probs[mask], atol=2e-3)
            assert packed.kl_coef == pytest.approx(state.kl.value, rel=1e-6)
            again, state = estimate_experience(
                _rollout_of(e), e.reward, e.reward_metrics,
                ForwardOutputs(e.action_log_probs, e.base_action_log_probs, e.values), config, state,
                e.batch_index,
            )
            for name in ("kl", "returns", "advantages", "shaped_reward", "rollout_is_weights"):
                assert torch.allclose(getattr(again, name), getattr(e, name), atol=1e-5), name
            delta = (e.action_log_probs - e.rollout_log_probs)[mask]  # TIS weights from the batch's own tensors
            assert torch.allclose(e.rollout_is_weights[mask], delta.exp().clamp(max=1.5), atol=1e-6)
            assert e.rollout_log_prob_abs_diff == pytest.approx(float(delta.abs().mean()), abs=1e-6)
            assert e.rollout_kl == pytest.approx(float((delta.exp() - 1 - delta).mean()), abs=1e-6)
            assert (again.reward_norm_mean, again.reward_norm_std) == (
                pytest.approx(e.reward_norm_mean, abs=1e-6), pytest.approx(e.reward_norm_std, rel=1e-5))
            assert again.advantage_clip_frac == pytest.approx(e.advantage_clip_frac)
        if request_number == 1:
            assert state.reward_moments.count == 8  # both requests' rewards are in the run's moments


async def test_over_long_prompts_are_truncated_left_or_skipped_as_the_request_says(stack, tiny_model_path):
    """prompt_overflow: TRUNCATE_LEFT keeps each long prompt's last max_prompt_tokens tokens; SKIP samples the
    others and reports the skipped ones like drops, in the message's indices; counted in trailing metadata."""
    long_prompt = "Count with me: one two three four five six seven eight nine ten eleven twelve."
    prompts = [long_prompt, "hi", long_prompt + " Go on.", "yo"]
    common = dict(n_samples_per_prompt=2, max_prompt_tokens=6, sampling=Sampling(max_new_tokens=4))
    call = stack["experience"].MakeExperiences(build_request(prompts, prompt_overflow="truncate_left", **common),
                                               timeout=300)
    batches = [experience_from_pb(m) async for m in call]
    trailers = dict(await call.trailing_metadata())
    assert trailers["fastexp-truncated-prompts"] == "2" and trailers["fastexp-skipped-prompts"] == "0"
    rows = {(p, e.prompt_texts[i]) for e in batches for i, p in enumerate(e.prompt_index)}
    assert sorted(p for p, _ in rows) == [0, 1, 2, 3]
    texts = dict(rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    ids = tokenizer(long_prompt, add_special_tokens=False)["input_ids"]
    assert texts[1] == "hi" and texts[0] == tokenizer.decode(ids[-6:]) and long_prompt.endswith(texts[0])
    assert texts[2].endswith(" Go on.") and len(texts[0]) < len(long_prompt)
    for e in batches:  # the sampled sequences hold the kept tokens only
        assert all(int(length) - int(r) <= 6 for length, r in zip(e.total_length, e.response_length, strict=True))
    call = stack["experience"].MakeExperiences(build_request(prompts, prompt_overflow="skip", **common), timeout=300)
    batches = [experience_from_pb(m) async for m in call]
    trailers = dict(await call.trailing_metadata())
    assert trailers["fastexp-skipped-prompts"] == "2" and trailers["fastexp-dropped-groups"] == "2"
    assert sorted(p for e in batches for p in e.prompt_index) == [1, 1, 3, 3]  # the message's indices
    assert batches[0].dropped_prompt_indices == (0, 2) and all(not e.dropped_prompt_indices for e in batches[1:])


async def test_stream_delivers_each_group_once_with_consistent_tensors(stack):
    n = 3
    request = build_request(
        PROMPTS, references=["5", "3", "7"], n_samples_per_prompt=n, micro_rollout_batch_size=6,
        sampling=Sampling(max_new_tokens=12, min_new_tokens=2, seed=1), kl_coef=0.05,
    )
    batches = await _collect(stack["experience"], request)
    rows = [(p, s) for e in batches for p, s in zip(e.prompt_index, e.sample_index, strict=True)]
    assert sorted(rows) == [(p, s) for p in range(3) for s in range(n)]  # each sample exactly once
    assert [e.batch_index for e in batches] == list(range(len(batches)))
    for e in batches:
        b, s = e.sequences.shape
        a = e.action_mask.shape[1]
        assert b % n == 0 and b <= 6  # whole groups, at most micro_rollout_batch_size rows
        for name in ("action_log_probs", "base_action_log_probs", "returns", "advantages", "kl",
                     "rollout_log_probs"):
            assert getattr(e, name).shape == (b, a) and getattr(e, name).dtype == torch.float32
        assert e.values is None and e.action_entropy is None and e.attention_mask.shape == (b, s)
        assert torch.equal(e.response_length, e.action_mask.sum(1))
        assert torch.equal(e.total_length, e.attention_mask.sum(1))
        assert e.response_length.min() >= 2  # min_new_tokens
        # responses are right-padded: the last A columns hold the response, starting at column S - A
        assert torch.equal(e.attention_mask[:, s - a:].bool(), e.action_mask)
        # actor (HF forward) agrees with the generator's sampled log-probs: masks and positions line up
        mask = e.action_mask
        assert torch.allclose(e.action_log_probs[mask], e.rollout_log_probs[mask], atol=2e-3)
        # actor and reference are the same weights here, so KL is zero
        assert torch.allclose(e.kl, torch.zeros_like(e.kl), atol=1e-5)
        assert set(e.reward_metrics) >= {"math_verify/correct", "math_verify/answer_found", "math_verify/failed"}
        # recompute the advantages from the streamed fields with the pure functions
        config = ExperienceConfig(n, get_estimator("group_norm"), kl=KLOptions(kl_coef=0.05))
        again, _ = estimate_experience(
            _rollout_of(e), e.reward, e.reward_metrics, ForwardOutputs(e.action_log_probs, e.base_action_log_probs),
            config, RunState(RunningMoments(), KLController(0.05)), e.batch_index,
        )
        assert torch.allclose(again.advantages, e.advantages)
        assert e.policy_version == (0,) * b and e.kl_coef == pytest.approx(0.05)


async def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(stack):
    stub = stack["experience"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, build_request(PROMPTS, n_samples_per_prompt=1, advantage_estimator="group_norm"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n_samples_per_prompt" in info.value.details() and "group std" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        bad = build_request(PROMPTS, n_samples_per_prompt=2)
        bad.sampling.top_p = 2.0  # one the SDK refuses to build (Sampling checks its ranges)
        await _collect(stub, bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.top_p" in info.value.details()
    health = await stack["health"].Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    batches = await _collect(stub, build_request(["hi"], n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4)))
    assert sum(len(e.prompt_index) for e in batches) == 2


async def test_generator_api_directly(stack):
    stub = stack["generator"]
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info.backend == "hf" and info.policy_version == 0 and info.max_model_len == 256
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="hello"),
                 generation_pb2.GenerationPrompt(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]))],
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=5),
        n_samples_per_prompt=2,
    )
    completions = [c async for r in stub.Generate(request, timeout=60) for c in r.completions]
    assert sorted((c.prompt_index, c.sample_index) for c in completions) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in completions:
        assert to_numpy(c.output_log_probs).shape == (len(c.output_token_ids),)
        assert c.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
    greedy = {c.prompt_index: [] for c in completions}
    for c in completions:
        greedy[c.prompt_index].append(tuple(c.output_token_ids))
    assert all(len(set(v)) == 1 for v in greedy.values())  # temperature 0 is greedy
    bad = generation_pb2.GenerateRequest(prompts=[generation_pb2.GenerationPrompt(text="")], n_samples_per_prompt=1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in stub.Generate(bad, timeout=10)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompts[0]" in info.value.details()


async def test_scorer_api_directly(stack):
    response = await stack["scorer"].Score(
        scoring_pb2.ScoreRequest(queries=["Q? The answer is 12.", "Q? 13"], prompts=["Q?", "Q?"],
                                 references=["12", "12"]), timeout=30)
    assert to_numpy(response.rewards).tolist() == [1.0, 0.0]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack["scorer"].Score(scoring_pb2.ScoreRequest(queries=["a"], prompts=["b"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "queries[0]" in info.value.details()


async def test_a_critic_update_is_live_for_the_next_batch_and_leaves_the_policy_alone(stack):
    """Runs last here: it replaces the critic. A value head of zeros plus a bias makes every value that bias."""
    from fastexp.weights import weight_chunks

    hidden = 64
    tensors = [("value_head.weight", torch.zeros(1, hidden)), ("value_head.bias", torch.tensor([0.5]))]

    async def messages():
        for message in weight_chunks(tensors, target="critic"):
            yield message

    response = await stack["experience"].UpdateWeights(messages(), timeout=60)
    assert (response.critic_version, response.policy_version, response.num_tensors) == (1, 0, 2)
    request = build_request(PROMPTS[:1], n_samples_per_prompt=2, advantage_estimator="gae",
                            sampling=Sampling(max_new_tokens=6))
    [e] = [experience_from_pb(m) async for m in stack["experience"].MakeExperiences(request, timeout=60)]
    assert torch.all(e.values[e.action_mask] == 0.5)
    assert e.actor_policy_version == 0 and set(e.policy_version) == {0}


async def test_images_for_a_text_only_policy_are_refused_naming_the_prompt(stack):
    from fastexp import invalid_prompt_indices
    from tests.support.vlm import sample_photos

    photo = sample_photos()["grace_hopper.jpg"]
    request = build_request(PROMPTS, images=[[], [photo], []], n_samples_per_prompt=2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(stack["experience"], request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[1].images: the policy is a text-only model" in caught.value.details()
    assert invalid_prompt_indices(caught.value) == [1]
    # the generator refuses them too, naming the prompt
    generate = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="a"),
                 generation_pb2.GenerationPrompt(text="b", media={"images": [{"data": photo}]})],
        n_samples_per_prompt=1,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [m async for m in stack["generator"].Generate(generate, timeout=30)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[1].media: the model is text-only" in caught.value.details()


async def test_a_sleeping_generator_fails_the_stream_with_failed_precondition_then_serves_again(stack, tiny_model_path):
    """A trainer that put the generator to sleep and forgot to wake it gets FAILED_PRECONDITION naming the cause
    (not UNAVAILABLE: nothing is down); after WakeUp and a full update the stream works at the new version."""
    generator, experience = stack["generator"], stack["experience"]
    request = build_request(PROMPTS[:1], n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4))
    await generator.Sleep(generation_pb2.SleepRequest(level=2))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _collect(experience, request)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "asleep" in caught.value.details()
    await generator.WakeUp(generation_pb2.WakeUpRequest())
    version = (await generator.UpdateWeights(iter(weight_chunks((), checkpoint_dir=tiny_model_path)))).policy_version
    batches = await _collect(experience, request)
    assert sum(len(e.prompt_index) for e in batches) == 2 and {v for e in batches for v in e.policy_version} == {version}

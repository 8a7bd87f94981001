"""Policy and critic updates through the experience service, and off-policy streaming (HF backend, tiny Llama,
float32, the three services in process): the generator and the actor replica follow an update together, versions
tag the right experiences, ``max_staleness`` is never exceeded, aborting partial rollouts resample."""

from __future__ import annotations

import grpc
import pytest
import torch

from fastexp import Sampling, build_request
from fastexp.tensor_codec import to_numpy
from fastexp.v1 import generation_pb2
from fastexp.weights import weight_chunks
from fastexp.wire import experience_from_pb
from tests.support.stack import three_services

N = 2


@pytest.fixture(scope="module")
async def stack(tiny_model_path, tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    # one sample per generate() call: an update can land (and an abort can cut in) between any two samples
    async with three_services(
        tiny_model_path, engine={"max_batch_size": 1},
        experience={"checkpoint_roots": [checkpoints]},  # the generator has none: it refuses checkpoint_dir updates
    ) as running:
        yield {"experience": running.experience_stub, "generator": running.generator_stub, "checkpoints": checkpoints}


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


async def _update(stub, tensors, target="policy"):
    async def messages():
        for message in weight_chunks(tensors, chunk_bytes=1 << 15, target=target):
            yield message

    return await stub.UpdateWeights(messages(), timeout=60)


async def _version(stack) -> int:
    return (await stack["generator"].GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)).policy_version


def _request(num_prompts, **options):
    prompts = [f"Count from {i}: {i}, {i + 1}," for i in range(num_prompts)]
    options.setdefault("sampling", Sampling(temperature=1.0, max_new_tokens=8))
    return build_request(prompts, n_samples_per_prompt=N, advantage_estimator="rloo", **options)


def _forward_log_probs(model, experience, row):
    mask = experience.action_mask[row]
    width = mask.shape[0]
    with torch.inference_mode():
        logits = model(input_ids=experience.sequences[row : row + 1],
                       attention_mask=experience.attention_mask[row : row + 1]).logits[0, -width - 1 : -1]
    tokens = experience.sequences[row, -width:]
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0][mask]


async def test_a_policy_update_moves_the_generator_and_the_actor_replica_together(stack, tiny_model_path):
    before = await _version(stack)
    perturbed = _model(tiny_model_path)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=g))
    response = await _update(stack["experience"], list(perturbed.state_dict().items()))
    assert response.policy_version == before + 1 == await _version(stack)
    assert response.num_tensors == len(perturbed.state_dict())
    batches = [experience_from_pb(m) async for m in stack["experience"].MakeExperiences(_request(2), timeout=120)]
    original = _model(tiny_model_path)
    for e in batches:
        assert set(e.policy_version) == {before + 1} and e.actor_policy_version == before + 1
        for row in range(len(e.policy_version)):
            sampled = e.rollout_log_probs[row][e.action_mask[row]]
            # the generator sampled with the new weights, and the actor replica scores with them
            torch.testing.assert_close(sampled, _forward_log_probs(perturbed, e, row), atol=1e-4, rtol=0)
            torch.testing.assert_close(e.action_log_probs[row][e.action_mask[row]], sampled, atol=1e-4, rtol=0)
            assert (sampled - _forward_log_probs(original, e, row)).abs().max() > 1e-2


async def _served(stack) -> tuple[list[int], list[float]]:
    """What the generator serves now: one seeded sample's tokens and log-probs (the same weights give the same)."""
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="Count: one, two,")], n_samples_per_prompt=1,
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
    )
    [completion] = [c async for r in stack["generator"].Generate(request, timeout=60) for c in r.completions]
    return list(completion.output_token_ids), to_numpy(completion.output_log_probs).tolist()


async def _actor_follows_generator(stack):
    """One batch whose actor log-probs are the generator's sampling log-probs: the actor replica holds the weights
    the generator serves."""
    [batch] = [experience_from_pb(m) async for m in stack["experience"].MakeExperiences(_request(1), timeout=60)]
    mask = batch.action_mask
    torch.testing.assert_close(batch.action_log_probs[mask], batch.rollout_log_probs[mask], atol=1e-4, rtol=0)
    return batch


async def test_a_bad_update_is_rejected_everywhere_and_the_old_weights_stay_served(stack, tiny_model_path):
    before = await _version(stack)
    served = await _served(stack)
    changed = _model(tiny_model_path).state_dict()["model.norm.weight"] * 3  # valid, and visible if applied
    perturbed = _model(tiny_model_path)
    with torch.no_grad():
        perturbed.model.norm.weight.mul_(3)
    checkpoint = stack["checkpoints"] / "norm-x3"
    perturbed.save_pretrained(checkpoint, safe_serialization=True)
    bad_updates = [
        ([("model.norm.weight", changed), ("model.no_such.weight", changed)], "policy", "tensors[model.no_such.weight]"),
        ([("model.norm.weight", changed[:-1])], "policy", "tensors[model.norm.weight]"),
        ([("value_head.weight", torch.zeros(1, 64))], "critic", "header.target"),
    ]
    for tensors, target, field in bad_updates:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _update(stack["experience"], tensors, target)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.value.details()
    # accepted by the experience service (under its checkpoint_roots), refused by the generator (none): through
    # the fleet, and nothing applied anywhere
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stack["experience"].UpdateWeights(iter(weight_chunks((), checkpoint_dir=str(checkpoint))), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checkpoint_dir" in error.value.details()
    assert await _version(stack) == before
    assert await _served(stack) == served  # the generator serves the old weights ...
    batch = await _actor_follows_generator(stack)  # ... and the actor replica holds them too
    assert batch.actor_policy_version == before and set(batch.policy_version) == {before}

    response = await _update(stack["experience"], [("model.norm.weight", changed)])  # the good one is served
    assert response.policy_version == before + 1 == await _version(stack)
    tokens, log_probs = await _served(stack)
    assert (tokens, log_probs) != served
    batch = await _actor_follows_generator(stack)
    assert batch.actor_policy_version == before + 1 and set(batch.policy_version) == {before + 1}


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_max_staleness_is_never_exceeded_while_the_trainer_updates_per_batch(stack, tiny_model_path,
                                                                                   max_staleness):
    """The trainer loop of one-step off-policy RL: receive batch b, 'train', UpdateWeights, receive b + 1."""
    unchanged = [("model.norm.weight", _model(tiny_model_path).state_dict()["model.norm.weight"])]
    v0 = await _version(stack)
    request = _request(6, micro_rollout_batch_size=N, max_staleness=max_staleness)
    rows = []
    async for message in stack["experience"].MakeExperiences(request, timeout=120):
        e = experience_from_pb(message)
        assert min(e.policy_version) >= v0 + e.batch_index - max_staleness, (e.batch_index, e.policy_version)
        if max_staleness == 0:  # generated only once the previous batch's update was live: exactly on-policy
            assert set(e.policy_version) == {v0 + e.batch_index} == {e.actor_policy_version}
        rows += list(zip(e.prompt_index, e.sample_index, strict=True))
        await _update(stack["experience"], unchanged)
    assert sorted(rows) == [(p, s) for p in range(6) for s in range(N)]


async def test_a_stream_waiting_for_the_trainers_update_ends_at_its_deadline(stack):
    request = _request(4, micro_rollout_batch_size=N, max_staleness=0)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for message in stack["experience"].MakeExperiences(request, timeout=8):
            received.append(message)  # no UpdateWeights: batch 1 may never be streamed
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(received) == 1


async def test_aborting_partial_rollouts_resample_what_an_update_interrupts(stack, tiny_model_path):
    unchanged = [("model.norm.weight", _model(tiny_model_path).state_dict()["model.norm.weight"])]
    v0 = await _version(stack)
    request = _request(8, micro_rollout_batch_size=N, partial_rollout="abort",
                       sampling=Sampling(temperature=1.0, max_new_tokens=24, min_new_tokens=24))
    call = stack["experience"].MakeExperiences(request, timeout=120)
    batches = []
    async for message in call:
        batches.append(experience_from_pb(message))
        if len(batches) == 1:
            await _update(stack["experience"], unchanged)  # lands while the other prompts are generating
    metadata = dict(await call.trailing_metadata())
    rows = sorted((p, s) for e in batches for p, s in zip(e.prompt_index, e.sample_index, strict=True))
    assert rows == [(p, s) for p in range(8) for s in range(N)]  # each group exactly once
    assert int(metadata["fastexp-resampled-groups"]) == sum(e.resampled_groups for e in batches) >= 1
    for e in batches:  # a group is sampled by one policy: interrupted groups were resampled whole
        assert len(set(e.policy_version)) == 1
    assert {v for e in batches for v in e.policy_version} == {v0, v0 + 1}

"""The pipeline's stages one at a time, on the real HF engine and a real tiny Llama: the producer's events and
backpressure, the forwarder's per-group outputs and assembly, and weight sync's all-or-nothing updates."""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch

from fastexp.rl.advantages import get_estimator
from fastexp.sampling import SamplingOptions
from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.weights import ReceivedUpdate, WeightStager
from services.experience.config import ExperienceConfig, ExperienceRequest, PromptSpec
from services.experience.pipeline.events import Done, RoundStarted, SampleFinished, SamplePreview, ScoredGroup
from services.experience.pipeline.forwarder import Forwarder, ForwardModels
from services.experience.pipeline.producer import Producer
from services.experience.pipeline.rollouts import RolloutParts
from services.experience.pipeline.versions import PolicyClocks
from services.experience.pipeline.weight_sync import WeightSync
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.sequences import build_rollout
from services.generator.hf_engine import HFEngine
from tests.support.inprocess import InProcessGenerator, InProcessRuleScorer

N = 2


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    return LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")


def _request(count: int, **options) -> ExperienceRequest:
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(count))
    config = ExperienceConfig(n_samples_per_prompt=N, estimator=get_estimator("group_norm"), **options)
    return ExperienceRequest("stage", prompts, SamplingOptions(max_new_tokens=6, min_new_tokens=2), config)


class RecordingGenerator(InProcessGenerator):
    """The in-process engine, recording how many prompts each generation request carried."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.sizes: list[int] = []

    def generate(self, request, deadline):
        self.sizes.append(len(request.prompts))
        return super().generate(request, deadline)


async def _next_group(run) -> ScoredGroup:
    while not isinstance(event := await asyncio.wait_for(run.events.get(), 60), ScoredGroup):
        pass
    return event


async def test_the_producer_emits_each_group_whole_and_in_sample_order_then_done(engine):
    run = Producer(RolloutParts(InProcessGenerator(engine), InProcessRuleScorer()), PolicyClocks(), 64).start(
        _request(3, micro_rollout_batch_size=N), Deadline.from_remaining(120)
    )
    events = [await asyncio.wait_for(run.events.get(), 60) for _ in range(5)]
    await run.close()
    assert isinstance(events[0], RoundStarted) and isinstance(events[-1], Done)
    groups = [e for e in events if isinstance(e, ScoredGroup)]
    assert sorted(g.prompt_index for g in groups) == [0, 1, 2]
    for group in groups:
        assert [c.sample_index for c in group.completions] == list(range(N))
        assert {c.prompt_index for c in group.completions} == {group.prompt_index}
        assert group.scores.rewards.shape == (N,)


class PreviewingGenerator(InProcessGenerator):
    """Announces every sample once (a SamplePreview, as the fleet does while it holds a group), then yields it."""

    async def generate(self, request, deadline):
        async for record in super().generate(request, deadline):
            yield SamplePreview(record)
            yield record


async def test_sample_previews_become_sample_finished_events_in_the_requests_indices(engine):
    run = Producer(RolloutParts(PreviewingGenerator(engine), InProcessRuleScorer()), PolicyClocks(), 64).start(
        _request(3, micro_rollout_batch_size=N), Deadline.from_remaining(120)
    )
    events = [await asyncio.wait_for(run.events.get(), 60)]
    while not isinstance(events[-1], Done):
        events.append(await asyncio.wait_for(run.events.get(), 60))
    await run.close()
    for group in (e for e in events if isinstance(e, ScoredGroup)):
        announced = [e.completion for e in events[: events.index(group)]
                     if isinstance(e, SampleFinished) and e.completion.prompt_index == group.prompt_index]
        assert [(c.sample_index, c.output_token_ids) for c in sorted(announced, key=lambda c: c.sample_index)] == [
            (c.sample_index, c.output_token_ids) for c in group.completions]


async def test_the_producers_window_admits_a_prompt_only_when_a_streamed_group_releases_its_slot(engine):
    generator = RecordingGenerator(engine)
    run = Producer(RolloutParts(generator, InProcessRuleScorer()), PolicyClocks(), max_groups_ahead=1).start(
        _request(3, micro_rollout_batch_size=N), Deadline.from_remaining(120)
    )
    first = await _next_group(run)
    await asyncio.sleep(0.5)
    assert generator.sizes == [1] and run.events.empty()  # held back: no slot until the consumer streams it
    run.window.end([first.prompt_index])
    second = await _next_group(run)
    run.window.end([second.prompt_index])
    third = await _next_group(run)
    await run.close()
    assert generator.sizes == [1, 1, 1]
    assert [first.prompt_index, second.prompt_index, third.prompt_index] == [0, 1, 2]


async def test_the_forwarder_returns_each_groups_outputs_as_an_independent_forward_computes_them(engine, actor):
    request = _request(2, micro_rollout_batch_size=2 * N)
    run = Producer(RolloutParts(InProcessGenerator(engine), InProcessRuleScorer()), PolicyClocks(), 64).start(
        request, Deadline.from_remaining(120)
    )
    groups = [await _next_group(run), await _next_group(run)]
    await run.close()
    forwarder = Forwarder(ForwardModels(actor, actor, None, micro_batch_size=3), pad_token_id=2, actor_version=7)
    forwarded = await forwarder.forward(groups, request)
    for group in forwarded:
        completions = group.scored.completions
        width = max(len(c.output_token_ids) for c in completions)
        assert group.forward.action_log_probs.shape == (N, width) and group.actor_version == 7
        alone = build_rollout(list(completions), request.prompts, 2)
        expected, _ = actor.action_log_probs(chunks(alone, 8, packed=False))
        mask = alone.action_mask
        torch.testing.assert_close(group.forward.action_log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    batch = forwarder.assemble(forwarded, request)
    assert batch.rollout.prompt_index == tuple(g.scored.prompt_index for g in forwarded for _ in range(N))
    assert batch.forward.action_log_probs.shape == batch.rollout.action_mask.shape
    assert torch.equal(batch.rewards, torch.cat([g.scored.scores.rewards for g in forwarded]))


def _update(tensors: dict[str, torch.Tensor], target: str = "policy") -> ReceivedUpdate:
    stager = WeightStager()
    for name, tensor in tensors.items():
        data = tensor.detach().numpy().tobytes()
        stager.add(name, "float32", tuple(tensor.shape), data, zlib.crc32(data))
    return ReceivedUpdate(target, "staged", str(stager.folder), stager.finish())


async def test_weight_sync_applies_a_policy_update_to_the_generator_then_the_actor(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)
    actor = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    forwarder = Forwarder(ForwardModels(actor, actor), pad_token_id=2)
    clocks = PolicyClocks()
    sync = WeightSync(InProcessGenerator(engine), forwarder, clocks)
    policy = clocks.base
    name = "model.norm.weight"
    new = torch.full_like(actor.tensors()[name], 0.5)
    await sync.update(_update({name: new}), Deadline.from_remaining(60))
    assert policy.version == 1 == engine.policy_version == forwarder.actor_version
    assert torch.equal(actor.tensors()[name], new)


async def test_weight_sync_applies_nothing_anywhere_from_a_bad_update(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)
    actor = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    sync = WeightSync(InProcessGenerator(engine), Forwarder(ForwardModels(actor, actor), pad_token_id=2), PolicyClocks())
    before = actor.tensors()["model.norm.weight"].detach().clone()
    with pytest.raises(InvalidRequest, match="no_such_tensor"):
        await sync.update(_update({"model.norm.weight": before + 1, "no_such_tensor": torch.zeros(2)}),
                          Deadline.from_remaining(60))
    with pytest.raises(InvalidRequest, match="runs no critic"):
        await sync.update(_update({"score.weight": torch.zeros(1)}, target="critic"), Deadline.from_remaining(60))
    assert sync.policy.version == 0 == engine.policy_version and sync.critic_version == 0
    assert torch.equal(actor.tensors()["model.norm.weight"], before)

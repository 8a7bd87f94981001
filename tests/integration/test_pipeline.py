"""ExperienceMaker in process on the real HF engine: generation faults, dynamic sampling's refill rounds,
backpressure and the normalization scope."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest
import torch

from fastexp.rl.advantages import get_estimator
from fastexp.rl.options import AdvantageOptions, KLOptions
from fastexp.sampling import SamplingOptions
from fastexp.types import Rollout
from services.common.deadlines import Deadline
from services.common.errors import NotReady, StreamFailed
from services.common.status import status_of
from services.experience.config import DynamicSamplingOptions, ExperienceConfig, ExperienceRequest, PromptSpec
from services.experience.pipeline.forwarder import Forwarder
from services.experience.pipeline.maker import ExperienceMaker, ForwardModels, Scores, StreamStats
from services.experience.workers.logprobs import LogProbModel
from services.generator.hf_engine import HFEngine
from tests.support.inprocess import InProcessGenerator, InProcessRuleScorer


class FailingAfter:
    """The real HF engine, with a fault injected: the stream breaks after ``limit`` completions."""

    def __init__(self, engine: HFEngine, limit: int) -> None:
        self._engine = engine
        self._limit = limit

    async def generate(self, request, deadline):
        count = 0
        async for record in self._engine.generate(request):
            if count == self._limit:
                raise NotReady("generator: UNAVAILABLE: connection lost")
            count += 1
            yield record


class ScriptedVerifier:
    """A rule scorer for control-flow tests: prompts whose text contains "solvable" get rewards 0, 1, 0, 1, ...
    (variance), every other prompt all zeros (no variance)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def score(self, batch, deadline):
        self.calls.append(batch.prompts[0])
        solvable = "solvable" in batch.prompts[0]
        return Scores(torch.tensor([float(solvable and i % 2) for i in range(len(batch.queries))]), {})


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=2)


@pytest.fixture(scope="module")
def models(tiny_model_path):
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    return ForwardModels(model, model, None, micro_batch_size=4)


async def test_groups_finished_before_a_generation_failure_are_delivered(engine, models):
    maker = ExperienceMaker(FailingAfter(engine, limit=4), InProcessRuleScorer(), models, pad_token_id=2)
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(4))
    request = ExperienceRequest(
        "fault", prompts, SamplingOptions(max_new_tokens=4),
        ExperienceConfig(2, get_estimator("rloo"), micro_rollout_batch_size=8),  # 4 groups per batch
    )
    delivered = []
    with pytest.raises(StreamFailed, match="connection lost") as raised:
        async for experience in maker.make_experiences(request, Deadline()):
            delivered.extend(experience.prompt_index)
    # HF generates in chunks of 2 sequences = one group each; 4 completions = groups 0 and 1, which wait for a
    # full batch (4 groups) when the failure comes
    assert sorted(delivered) == [0, 0, 1, 1]
    assert isinstance(raised.value.cause, NotReady) and status_of(raised.value)[0] == grpc.StatusCode.UNAVAILABLE
    assert raised.value.undelivered == [2, 3]  # what a retry sends again: nothing delivered is repeated


def _prompts(kinds: str) -> tuple[PromptSpec, ...]:
    """``kinds``: one letter per prompt, ``s`` solvable (reward variance) or ``u`` unsolvable."""
    names = {"s": "solvable", "u": "hopeless"}
    return tuple(PromptSpec(f"{names[k]} {i}", (100 + i, 101, 102), "", "") for i, k in enumerate(kinds))


async def _run(maker, prompts, num_groups, max_extra_rounds):
    request = ExperienceRequest(
        "dyn", prompts, SamplingOptions(max_new_tokens=3),
        ExperienceConfig(2, get_estimator("group_norm"), micro_rollout_batch_size=2,
                         dynamic_sampling=DynamicSamplingOptions(num_groups, max_extra_rounds)),
    )
    stats = StreamStats()
    batches = [e async for e in maker.make_experiences(request, Deadline(), stats)]
    return batches, stats


async def test_dynamic_sampling_drops_zero_variance_groups_and_refills(engine, models):
    verifier = ScriptedVerifier()
    maker = ExperienceMaker(InProcessGenerator(engine), verifier, models, pad_token_id=2)
    # want 2 groups: round 1 samples prompts 0, 1 (0 dropped, 1 kept); each refill samples the one missing
    # group: round 2 prompt 2 (dropped), round 3 prompt 3 (dropped), round 4 prompt 4 (kept); 5 never runs
    batches, stats = await _run(maker, _prompts("usuuss"), num_groups=2, max_extra_rounds=3)
    delivered = sorted({p for e in batches for p in e.prompt_index})
    assert delivered == [1, 4]
    assert stats.generation_rounds == 4 and stats.dropped_groups == 3
    dropped = [p for e in batches for p in e.dropped_prompt_indices]
    assert sorted(dropped) == [0, 2, 3]  # reported on the batch after each drop
    assert sorted(verifier.calls) == sorted(p.text for p in _prompts("usuuss")[:5])
    for e in batches:  # kept groups have reward variance, so group_norm gives them nonzero advantages
        assert e.reward.tolist() == [0.0, 1.0] and e.advantages.abs().sum() > 0


async def test_dynamic_sampling_stops_after_max_extra_rounds(engine, models):
    maker = ExperienceMaker(InProcessGenerator(engine), ScriptedVerifier(), models, pad_token_id=2)
    batches, stats = await _run(maker, _prompts("uuuuus"), num_groups=2, max_extra_rounds=1)
    # round 1: prompts 0, 1 dropped; round 2: prompts 2, 3 dropped; no rounds left -> nothing delivered
    assert batches == [] and stats.generation_rounds == 2 and stats.dropped_groups == 4
    batches, stats = await _run(maker, _prompts("uuus"), num_groups=2, max_extra_rounds=5)
    # the prompts run out: rounds of 2 and 2 prompts, one group kept
    assert [p for e in batches for p in e.prompt_index] == [3, 3] and stats.generation_rounds == 2


class ScorerDownAfter:
    """The scripted verifier, with a fault injected: every call after the first ``limit`` fails."""

    def __init__(self, limit: int) -> None:
        self._inner = ScriptedVerifier()
        self._limit = limit

    async def score(self, batch, deadline):
        if len(self._inner.calls) >= self._limit:
            raise NotReady("scorer: UNAVAILABLE: connection refused")
        return await self._inner.score(batch, deadline)


async def test_a_scorer_failure_stops_generation_and_is_raised_after_scored_groups(engine, models):
    maker = ExperienceMaker(InProcessGenerator(engine), ScorerDownAfter(limit=1), models, pad_token_id=2)
    request = ExperienceRequest(
        "scorer-down", _prompts("ssss"), SamplingOptions(max_new_tokens=3),
        ExperienceConfig(2, get_estimator("group_norm"), micro_rollout_batch_size=2),
    )
    delivered = []
    with pytest.raises(StreamFailed, match="scorer") as raised:
        async for experience in maker.make_experiences(request, Deadline()):
            delivered.extend(experience.prompt_index)
    assert delivered == [0, 0]  # the one group scored before the failure arrives; nothing is delivered twice
    assert isinstance(raised.value.cause, NotReady) and raised.value.undelivered == [1, 2, 3]


class CountingGenerator:
    """The engine called directly, counting the prompts sent to it and the completions it has produced."""

    def __init__(self, engine: HFEngine) -> None:
        self._engine = engine
        self.submitted = 0
        self.completed = 0

    async def generate(self, request, deadline):
        self.submitted += len(request.prompts)
        async for record in self._engine.generate(request):
            self.completed += 1
            yield record


async def test_a_slow_trainer_holds_generation_back(engine, models):
    generator = CountingGenerator(engine)
    maker = ExperienceMaker(generator, InProcessRuleScorer(), models, pad_token_id=2, max_groups_ahead=2)
    request = ExperienceRequest(
        "slow-trainer", _prompts("ssssss"), SamplingOptions(max_new_tokens=3),
        ExperienceConfig(2, get_estimator("rloo"), micro_rollout_batch_size=2),  # one group per batch
    )
    stream = maker.make_experiences(request, Deadline())
    first = await anext(stream)
    await asyncio.sleep(1.0)  # the trainer's step; all 6 prompts would be generated by now without the window
    assert generator.submitted == 2, "generation ran ahead of a trainer that is not reading"
    rest = [e async for e in stream]
    assert generator.submitted == 6
    assert sorted(p for e in [first, *rest] for p in e.prompt_index) == [p for p in range(6) for _ in range(2)]


async def test_rollout_scope_whitens_over_the_whole_request_and_streams_after_it(engine, models):
    generator = CountingGenerator(engine)
    maker = ExperienceMaker(generator, ScriptedVerifier(), models, pad_token_id=2)
    options = dict(micro_rollout_batch_size=2, advantage=AdvantageOptions(advantages_norm=True))
    prompts = _prompts("susu")

    async def run(scope):
        request = ExperienceRequest("scope", prompts, SamplingOptions(max_new_tokens=3),
                                    ExperienceConfig(2, get_estimator("reinforce"), normalization_scope=scope, **options))
        batches, completed_at_first = [], None
        async for experience in maker.make_experiences(request, Deadline()):
            completed_at_first = generator.completed if completed_at_first is None else completed_at_first
            batches.append(experience)
        return batches, completed_at_first

    batches, completed_at_first = await run("rollout")
    assert completed_at_first == 8, "a rollout-scope batch streamed before the last group was generated"
    assert [e.batch_index for e in batches] == [0, 1, 2, 3] and all(len(e.reward) == 2 for e in batches)
    tokens = torch.cat([e.advantages[e.action_mask] for e in batches])
    assert abs(float(tokens.mean())) < 1e-5 and float(tokens.std()) == pytest.approx(1.0, abs=1e-4)
    per_batch, _ = await run("batch")
    for experience in per_batch:  # each batch whitened alone: zero mean within every batch
        assert abs(float(experience.advantages[experience.action_mask].mean())) < 1e-5
    # a solvable group's batch alone differs from its rows whitened with the whole request
    solvable = [e for e in batches if e.prompt_index[0] == 0][0]
    alone = [e for e in per_batch if e.prompt_index[0] == 0][0]
    assert not torch.allclose(solvable.advantages, alone.advantages)


class CountingModel:
    """The real log-prob model, counting the forward passes it runs."""

    def __init__(self, model: LogProbModel) -> None:
        self._model = model
        self.calls = 0
        self.vision_tokens = model.vision_tokens
        self.module = model.module

    def action_log_probs(self, parts, with_entropy=False):
        self.calls += 1
        return self._model.action_log_probs(parts, with_entropy=with_entropy)

    def tensors(self):
        return self._model.tensors()


async def test_forwards_a_request_does_not_need_are_not_run(engine, tiny_model_path):
    """skip_actor_forward: action_log_probs are the generator's own; kl_coef 0 (no kl_target, no use_kl_loss):
    no reference forward, and base_action_log_probs and kl are absent. Both: generation and scoring only."""
    from fastexp.rl.options import KLOptions

    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    actor, reference = CountingModel(model), CountingModel(model)
    maker = ExperienceMaker(InProcessGenerator(engine), InProcessRuleScorer(),
                            ForwardModels(actor, reference, None, micro_batch_size=4), pad_token_id=2)
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(2))

    async def run(**options):
        config = ExperienceConfig(2, get_estimator("rloo"), micro_rollout_batch_size=4, **options)
        request = ExperienceRequest("skip", prompts, SamplingOptions(max_new_tokens=5, min_new_tokens=2), config)
        return [e async for e in maker.make_experiences(request, Deadline())]

    (lean,) = await run(skip_actor_forward=True, kl=KLOptions(kl_coef=0.0))
    assert actor.calls == reference.calls == 0
    assert torch.equal(lean.action_log_probs, lean.rollout_log_probs)
    assert lean.base_action_log_probs is None and lean.kl is None
    assert lean.actor_policy_version == min(lean.policy_version)
    # rewards without a KL term: each row's return is its shaped reward on every action token (gamma 1)
    assert torch.allclose(lean.returns[:, 0], lean.shaped_reward)

    (with_kl,) = await run(skip_actor_forward=True)  # kl_coef 0.01: the reference runs, the actor does not
    assert actor.calls == 0 and reference.calls >= 1 and with_kl.kl is not None  # (a pass per ready group set)
    (full,) = await run()
    assert actor.calls >= 1
    assert full.base_action_log_probs is not None and not torch.equal(full.action_log_probs, full.rollout_log_probs)


class ThreadRecordingModel(CountingModel):
    """Records the torch thread count each forward pass ran with."""

    def __init__(self, model: LogProbModel) -> None:
        super().__init__(model)
        self.threads: list[int] = []

    def action_log_probs(self, parts, with_entropy=False):
        self.threads.append(torch.get_num_threads())
        return super().action_log_probs(parts, with_entropy)


class AskedThreads:
    """Hands out thread counts in order, and records how many passes were waiting at each ask."""

    def __init__(self, counts, shared: bool = False) -> None:
        self._counts, self.pending, self.seen, self._shared = iter(counts), 0, [], shared

    def shared(self) -> bool:
        return self._shared

    @contextlib.contextmanager
    def waiting(self):
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def threads(self):
        self.seen.append(self.pending)
        return next(self._counts)


async def test_each_forward_pass_runs_on_the_threads_asked_for_when_it_starts(engine, tiny_model_path):
    """The service asks before every pass how many CPU threads it may use (more while no generation is in flight,
    :class:`services.experience.fleet.cores.CoreShare`), inside the span it counts as waiting; the pass runs with
    that many, in its worker thread."""
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    actor = ThreadRecordingModel(model)
    asked = AskedThreads([2, 1, 2, 1, 2, 1, 2, 1])
    maker = ExperienceMaker(InProcessGenerator(engine), InProcessRuleScorer(),
                            ForwardModels(actor, CountingModel(model), None, micro_batch_size=2), pad_token_id=2,
                            cores=asked)
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(3))
    config = ExperienceConfig(2, get_estimator("rloo"), micro_rollout_batch_size=2)
    request = ExperienceRequest("threads", prompts, SamplingOptions(max_new_tokens=4), config)
    previous = torch.get_num_threads()
    try:
        batches = [e async for e in maker.make_experiences(request, Deadline())]
    finally:
        torch.set_num_threads(previous)
    assert len(batches) == 3 and len(actor.threads) >= 2
    assert actor.threads == [2, 1, 2, 1, 2, 1][: len(actor.threads)]
    assert asked.seen and all(pending >= 1 for pending in asked.seen) and asked.pending == 0


def test_samples_are_forwarded_early_only_where_that_pays(tiny_model_path):
    # not where the passes share an engine's cores (each takes the engine's threads for less work than it saves),
    # not where no model runs (skip_actor_forward without a reference), not with dynamic sampling
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    models = ForwardModels(model, model, None, micro_batch_size=2)
    config = ExperienceConfig(2, get_estimator("rloo"))
    apart = Forwarder(models, pad_token_id=2, cores=AskedThreads([], shared=False))
    shared = Forwarder(models, pad_token_id=2, cores=AskedThreads([], shared=True))
    assert apart.early_forwards(config) and Forwarder(models, pad_token_id=2).early_forwards(config)
    assert not shared.early_forwards(config)
    assert apart.early_forwards(dataclasses.replace(config, skip_actor_forward=True))  # the reference still runs
    lean = dataclasses.replace(config, skip_actor_forward=True, kl=KLOptions(kl_coef=0.0))
    assert not apart.early_forwards(lean)
    assert not apart.early_forwards(dataclasses.replace(config, dynamic_sampling=DynamicSamplingOptions(num_groups=1)))


async def test_samples_are_forwarded_before_their_group_completes_and_never_twice(engine, tiny_model_path):
    """Through the real fleet and generator service: the HF engine here samples 2 sequences per generate call, so
    a group of 4 finishes in two halves; the fleet announces the first half (SamplePreview) while it holds the
    group, the consumer forwards those rows while the rest decode, and the group's forward computes only the others.
    Every row is forwarded once, with the same log-probs as one forward of the whole batch; some row is forwarded
    before its group is scored (only a whole group is scored), in a pass holding only part of its group."""
    from services.common.channels import open_channel
    from services.experience.fleet.clients import GeneratorClient
    from services.experience.fleet.generator_fleet import GeneratorFleet
    from services.experience.fleet.replicas import FleetSettings
    from services.experience.workers.inputs import chunks
    from services.generator.server import start_generator
    from services.generator.settings import GeneratorSettings

    server = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    address = f"127.0.0.1:{server.port}"
    fleet = GeneratorFleet([address], lambda a: GeneratorClient(open_channel(a, 64 * 2**20), 60, 60, a),
                           FleetSettings())
    model = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    timeline: list[tuple[str, object]] = []  # ("forward", rows of one pass) and ("scored", prompt index), in order
    maker = ExperienceMaker(fleet, ScoringRecorder(timeline), ForwardModels(model, model, None, micro_batch_size=8),
                            pad_token_id=2)
    forward_rows = maker._forwarder._forward_rows

    def recording(completions, request, threads):  # (runs in the forwarder's worker thread; list.append is atomic)
        timeline.append(("forward", tuple((c.prompt_index, c.sample_index) for c in completions)))
        return forward_rows(completions, request, threads)

    maker._forwarder._forward_rows = recording
    prompts = tuple(PromptSpec(f"p{i}", (100 + i, 101, 102), "1", "") for i in range(2))
    config = ExperienceConfig(4, get_estimator("rloo"), micro_rollout_batch_size=8)
    request = ExperienceRequest("early", prompts, SamplingOptions(max_new_tokens=6, min_new_tokens=6), config)
    watching = asyncio.create_task(fleet.run())
    try:
        for _ in range(400):  # the fleet probes the new replica before routing to it
            if any(fleet.members.routable(r) for r in fleet.replicas):
                break
            await asyncio.sleep(0.05)
        (experience,) = [e async for e in maker.make_experiences(request, Deadline())]
    finally:
        watching.cancel()
        await server.stop(1)
    passes = [rows for kind, rows in timeline if kind == "forward" and rows]
    assert sorted(row for rows in passes for row in rows) == [(p, s) for p in range(2) for s in range(4)]  # once each
    assert _forwarded_before_scoring(timeline), f"no row was forwarded before its group was scored: {timeline}"
    assert any(0 < sum(p == prompt for p, _ in rows) < 4 for rows in passes for prompt in range(2))  # part of a group
    rollout = Rollout(experience.sequences, experience.attention_mask, experience.action_mask,
                      experience.response_length, experience.total_length, experience.prompt_index,
                      experience.sample_index, experience.prompt_texts, experience.response_texts,
                      experience.policy_version, experience.rollout_log_probs)
    whole, _ = model.action_log_probs(chunks(rollout, 8, packed=False))
    mask = experience.action_mask
    assert torch.allclose(experience.action_log_probs[mask], whole[mask], atol=1e-5)


class ScoringRecorder(InProcessRuleScorer):
    """math-verify called directly, noting each group's scoring (its prompt index, from ``p<i>``) in ``timeline``."""

    def __init__(self, timeline: list) -> None:
        self._timeline = timeline

    async def score(self, batch, deadline):
        self._timeline.append(("scored", int(batch.prompts[0].removeprefix("p"))))
        return await super().score(batch, deadline)


def _forwarded_before_scoring(timeline: list) -> list[tuple[int, int]]:
    """The rows of ``timeline``'s forward passes whose group had not been scored yet when the pass ran."""
    scored: set[int] = set()
    early = []
    for kind, item in timeline:
        if kind == "scored":
            scored.add(item)
        else:
            early.extend(row for row in item if row[0] not in scored)
    return early

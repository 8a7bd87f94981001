"""Early forwards and weight updates (ExperienceMaker in process, real HF engine and log-prob models, tiny Llama,
float32): a row forwarded before its group was whole is not reused once an actor update landed in between; the
group's log-probs are those of the new weights."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from fastexp.rl.advantages import get_estimator
from fastexp.sampling import SamplingOptions
from fastexp.types import Rollout
from services.common.deadlines import Deadline
from services.common.weights import ReceivedUpdate, checkpoint_entries
from services.experience.config import ExperienceConfig, ExperienceRequest, PromptSpec
from services.experience.pipeline.events import SamplePreview
from services.experience.pipeline.maker import ExperienceMaker, ForwardModels
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.generator.hf_engine import HFEngine
from tests.support.inprocess import InProcessGenerator, InProcessRuleScorer

N = 4


class HeldGroupGenerator(InProcessGenerator):
    """The engine called directly, as the fleet would announce a group it holds: the first sample of each group as
    a :class:`SamplePreview`, then the whole group only once ``release`` is set (the rest "still decoding")."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.release = asyncio.Event()

    async def generate(self, request, deadline):
        records = [record async for record in self._engine.generate(request)]
        for record in records:
            if record.sample_index == 0:
                yield SamplePreview(record)
        await self.release.wait()
        for record in records:
            yield record


class SignallingModel:
    """The real log-prob model, setting ``called`` (a thread event: passes run in a worker thread) after each pass
    and counting them."""

    def __init__(self, model: LogProbModel) -> None:
        self._model = model
        self.calls = 0
        self.called = threading.Event()
        self.vision_tokens = model.vision_tokens
        self.module = model.module

    def action_log_probs(self, parts, with_entropy=False):
        result = self._model.action_log_probs(parts, with_entropy=with_entropy)
        self.calls += 1
        self.called.set()
        return result

    def tensors(self):
        return self._model.tensors()


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=N)


def _perturbed_checkpoint(model_path: str, folder) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=g))
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _log_probs(model: LogProbModel, experience) -> torch.Tensor:
    """A fresh forward of the streamed rows under ``model``: (B, A) action log-probs."""
    e = experience
    rollout = Rollout(e.sequences, e.attention_mask, e.action_mask, e.response_length, e.total_length,
                      e.prompt_index, e.sample_index, e.prompt_texts, e.response_texts, e.policy_version,
                      e.rollout_log_probs)
    return model.action_log_probs(chunks(rollout, 8, packed=False))[0]


async def test_rows_forwarded_early_are_dropped_after_an_actor_update(engine, tiny_model_path, tmp_path):
    actor = SignallingModel(LogProbModel.load(tiny_model_path, dtype="float32", device="cpu"))
    reference = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    generator = HeldGroupGenerator(engine)
    maker = ExperienceMaker(generator, InProcessRuleScorer(), ForwardModels(actor, reference, None, micro_batch_size=8),
                            pad_token_id=2)
    prompts = (PromptSpec("p0", (100, 101, 102), "1", ""),)
    request = ExperienceRequest("early-update", prompts, SamplingOptions(max_new_tokens=6, min_new_tokens=6),
                                ExperienceConfig(N, get_estimator("rloo"), micro_rollout_batch_size=N))
    stream = maker.make_experiences(request, Deadline.from_remaining(300))
    first = asyncio.create_task(anext(stream))
    # the preview of sample 0 is forwarded while its group is held: one actor pass of one row
    assert await asyncio.to_thread(actor.called.wait, 120), "sample 0 was not forwarded early"
    assert actor.calls == 1 and not first.done()
    folder = _perturbed_checkpoint(tiny_model_path, tmp_path / "perturbed")
    update = ReceivedUpdate("policy", "checkpoint", folder, checkpoint_entries(folder))
    await maker.update_weights(update, Deadline.from_remaining(120))  # waits for the early pass (one lock)
    generator.release.set()
    experience = await asyncio.wait_for(first, 120)
    assert [e async for e in stream] == []
    assert actor.calls == 2 and experience.actor_policy_version == 1

    updated = LogProbModel.load(folder, dtype="float32", device="cpu")
    original = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")
    mask = experience.action_mask
    # every row, the early one included, has the updated weights' log-probs ...
    torch.testing.assert_close(experience.action_log_probs[mask], _log_probs(updated, experience)[mask],
                               atol=1e-5, rtol=0)
    # ... and the old weights' differ (so a cached early row would show)
    row = list(experience.sample_index).index(0)
    old = _log_probs(original, experience)[row][mask[row]]
    assert (experience.action_log_probs[row][mask[row]] - old).abs().max() > 1e-2

"""A trainer cancelling its ``MakeExperiences`` stream ends the judge calls that stream's groups started.

The three services in process (HF backend, tiny Llama) with the scorer judging through an OpenAI-compatible judge
server that never answers (:mod:`tests.support.judge_server`, ``/hang``): once the judge server holds every judge
request of the stream's groups, the trainer cancels; the experience service cancels its Score calls, the scorer
cancels its judge calls, and the judge server sees each request end (its connection closed), with no answer sent.
"""

from __future__ import annotations

import asyncio

import pytest

from fastexp import Sampling, build_request
from tests.support.http_servers import serving
from tests.support.judge_server import JudgeLog, judge_app
from tests.support.stack import three_services

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nScore it from 0 to 9 in \\boxed{}."
NUM_PROMPTS, N_SAMPLES = 2, 2


@pytest.fixture(scope="module")
async def stack(tiny_model_path):
    app = judge_app()
    with serving(app) as url:
        judge = {"sources": [
            {"type": "judge", "name": "hanging", "backend": "openai", "url": f"{url}/hang/v1", "model": "judge",
             "template": TEMPLATE, "score_range": [0, 9], "max_attempts": 1, "cache": {"enabled": False}},
        ], "recipes": {"default": [("model", "hanging", 1.0)]}}
        async with three_services(tiny_model_path, scorer=judge, experience={"score_timeout_s": 300},
                                  ready_timeout_s=120) as running:
            yield running.experience_stub, app.state.log


async def test_cancelling_a_stream_ends_its_judge_calls_in_flight(stack):
    stub, log = stack
    log: JudgeLog
    started, disconnected, answered = log.started, log.disconnected, log.answered
    request = build_request([f"Count from {i}:" for i in range(NUM_PROMPTS)], n_samples_per_prompt=N_SAMPLES,
                            advantage_estimator="rloo", sampling=Sampling(temperature=1.0, max_new_tokens=4))
    call = stub.MakeExperiences(request, timeout=600)
    # every sample of every group is being judged (one judge request per response), none answered
    await asyncio.to_thread(log.wait_for, lambda s: s.started - started == NUM_PROMPTS * N_SAMPLES, 300.0)
    call.cancel()
    await asyncio.to_thread(log.wait_for, lambda s: s.disconnected - disconnected == NUM_PROMPTS * N_SAMPLES, 120.0)
    assert log.answered == answered  # the judge never answered: the calls ended because the stream did
    with pytest.raises(asyncio.CancelledError):
        await call.read()

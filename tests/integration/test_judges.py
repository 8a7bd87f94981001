"""LLM judges through real parts: a fastexp generator (HF, the embedded SmolLM2) and an OpenAI-compatible server
(FastAPI + uvicorn on a loopback port, :mod:`tests.support.judge_server`), behind the real scorer service.

Covered: verdicts parsed (garbage failing its item, named), the cache saving judge calls, yes/no log-probs, budgets
holding under 8 concurrent Score streams, a dead judge opening its breaker (rows failing fast with its name, health
NOT_SERVING) and recovering, and a cancelled Score call closing the judge's requests in flight.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from fastexp.tensor_codec import to_numpy
from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.deadlines import Deadline
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.composition import RewardComposer, build_composer
from services.scorer.judges.config import JudgeConfig
from services.scorer.judges.source import JudgeScorer
from services.scorer.scorer import ScoreItem
from services.scorer.server import breaker_health_name, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.http_servers import serving
from tests.support.judge_server import JudgeLog, judge_app

TEMPLATE = "Question: {prompt}\nReference: {reference}\nAnswer: {response}\nScore it from 0 to 9 in \\boxed{}."


def judge(name: str, url: str, **fields) -> dict:
    return {"type": "judge", "name": name, "backend": "openai", "url": url, "model": "judge", "template": TEMPLATE,
            "score_range": [0, 9], "max_attempts": 1, "backoff_initial_s": 0.05, **fields}


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def judge_server():
    app = judge_app()
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
async def scorer(judge_server):
    """One scorer service with judges on each of the server's modes; its Score stub."""
    url, _ = judge_server
    settings = ScorerSettings(port=0, sources=[
        judge("cached", f"{url}/ok/v1"),
        judge("yes", f"{url}/ok/v1", score_range=[0, 1], verdict={"kind": "yes_no"}, cache={"enabled": False}),
        judge("budgeted", f"{url}/ok/v1", budget={"max_concurrency": 2}, cache={"enabled": False}),
        judge("hanging", f"{url}/hang/v1", budget={"max_concurrency": 8}, cache={"enabled": False}),
        judge("mixed", f"{url}/faulty/v1", cache={"enabled": False}),
    ], recipes={name: [("model", name, 1.0)] for name in ("cached", "yes", "budgeted", "hanging", "mixed")})
    composer = build_composer(settings)
    running = await start_scorer(settings, composer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield scoring_pb2_grpc.ScoringServiceStub(channel)
    await channel.close()
    await running.stop(1)
    await composer.close()


def request(label: str, *responses: str) -> scoring_pb2.ScoreRequest:
    prompt = "What is 3 + 4? "
    return scoring_pb2.ScoreRequest(queries=[prompt + r for r in responses], prompts=[prompt] * len(responses),
                                    labels=[label] * len(responses), references=["7"] * len(responses))


async def wait(log: JudgeLog, predicate) -> None:
    await asyncio.to_thread(log.wait_for, predicate, 60.0)


async def test_judge_over_an_openai_server_parses_verdicts_names_garbage_and_caches(scorer, judge_server):
    _, app = judge_server
    log: JudgeLog = app.state.log
    answers = ["seven", "7", "the answer is 7", "garbage", "7"]  # two identical items: judged once
    before = log.answered
    reply = await scorer.Score(request("cached", *answers), timeout=60)
    rewards, errors = to_numpy(reply.rewards), list(reply.errors)
    for i, answer in enumerate(answers):
        if answer == "garbage":  # a failure, named and quoted, never a 0
            assert math.isnan(rewards[i]) and errors[i].startswith("cached (openai http")
            assert "no \\boxed{}" in errors[i] and "I cannot judge this." in errors[i]
        else:
            assert rewards[i] == pytest.approx((len(answer) % 10) / 9) and errors[i] == ""
    assert log.answered - before == 4
    metrics = {name: to_numpy(values) for name, values in reply.metrics.items()}
    assert metrics["cached/score"][0] == 5 and metrics["cached/prompt_tokens"][0] > 0
    assert list(metrics["cached/cached"]) == [0, 0, 0, 0, 1]

    hits = metric("fastexp_reward_source_cache_lookups_total", source="cached", result="hit")
    again = await scorer.Score(request("cached", *answers), timeout=60)
    assert log.answered - before == 5  # only the garbage item was judged again (failures are not cached)
    assert list(to_numpy(again.metrics["cached/cached"])) == [1, 1, 1, 0, 1]
    assert np.array_equal(to_numpy(again.rewards)[[0, 1, 2, 4]], rewards[[0, 1, 2, 4]])
    assert metric("fastexp_reward_source_cache_lookups_total", source="cached", result="hit") - hits == 4
    assert metric("fastexp_reward_source_tokens_total", source="cached", kind="completion") >= 15


async def test_a_request_whose_judge_calls_partly_fail_scores_the_rest_and_names_the_failures(scorer):
    # one item's call gets HTTP 500, the other's a verdict: the RPC answers, the failed item is NaN with its error
    # and NaN metrics, the other keeps its reward and metrics (a failed call's part has no metrics to join)
    reply = await scorer.Score(request("mixed", "7", "fail here", "seven"), timeout=60)
    rewards, errors = to_numpy(reply.rewards), list(reply.errors)
    assert rewards[0] == pytest.approx(1 / 9) and rewards[2] == pytest.approx(5 / 9) and errors[0] == errors[2] == ""
    assert math.isnan(rewards[1]) and errors[1].startswith("mixed (openai http") and "HTTP 500" in errors[1]
    scores = to_numpy(reply.metrics["mixed/score"])
    assert scores[0] == 1 and scores[2] == 5 and math.isnan(scores[1])


async def test_yes_no_verdicts_read_the_first_tokens_log_probs(scorer):
    reply = await scorer.Score(request("yes", "7", "8"), timeout=60)
    assert to_numpy(reply.rewards) == pytest.approx([0.8, 0.8])  # P(Yes) 0.8 / (0.8 + P(No) 0.2)


async def test_budgets_hold_under_eight_concurrent_streams(scorer, judge_server):
    _, app = judge_server
    log: JudgeLog = app.state.log
    log.update(lambda s: setattr(s, "peak", s.in_flight))
    streams = [scorer.Score(request("budgeted", *(f"{s} {i}" for i in range(3))), timeout=120) for s in range(8)]
    replies = await asyncio.gather(*streams)
    assert all(not reply.errors and np.isfinite(to_numpy(reply.rewards)).all() for reply in replies)
    assert log.peak <= 2  # budget.max_concurrency: the other 22 calls queued, none failed


async def test_cancelling_a_score_call_ends_the_judge_calls_in_flight(scorer, judge_server):
    _, app = judge_server
    log: JudgeLog = app.state.log
    started, disconnected = log.started, log.disconnected
    cancelled = metric("fastexp_reward_source_calls_total", source="hanging", outcome="cancelled")
    call = scorer.Score(request("hanging", "a", "b", "c"), timeout=300)
    await wait(log, lambda s: s.started - started == 3)  # all three judge requests are in flight
    call.cancel()
    await wait(log, lambda s: s.disconnected - disconnected == 3)  # and the judge server saw each one end
    with pytest.raises(asyncio.CancelledError):
        await call
    # each call counts itself cancelled as its cancellation unwinds, which may end after the judge server saw the
    # connection close: waited for (the metric), not read at once
    async with asyncio.timeout(60):
        while metric("fastexp_reward_source_calls_total", source="hanging", outcome="cancelled") - cancelled < 3:
            await asyncio.sleep(0.01)
    assert metric("fastexp_reward_source_calls_total", source="hanging", outcome="cancelled") - cancelled == 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _health(stub: health_pb2_grpc.HealthStub, source: str) -> int:
    """The breaker's health status (set by a task the breaker's change scheduled before the Score reply left)."""
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=breaker_health_name(source)), timeout=10)
    return reply.status


async def test_a_dead_judge_opens_its_breaker_fails_fast_by_name_and_recovers(judge_server):
    url, app = judge_server
    log: JudgeLog = app.state.log
    app.state.down = True
    clock = Clock()
    config = JudgeConfig.model_validate(judge("flaky", f"{url}/flaky/v1", breaker={"failure_threshold": 2,
                                                                                   "open_s": 30}))
    settings = ScorerSettings(port=0, sources=[config])
    composer = RewardComposer([JudgeScorer(config, clock=clock)], {"flaky": None}, {"default": [("flaky", 1.0)]})
    running = await start_scorer(settings, composer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub, health = scoring_pb2_grpc.ScoringServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    try:
        for _ in range(2):  # two failed calls: the breaker opens
            reply = await stub.Score(request("", "7"), timeout=60)
            assert "HTTP 503" in reply.errors[0] and reply.errors[0].startswith("flaky (openai ")
        assert await _health(health, "flaky") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert metric("fastexp_reward_source_breaker_state", source="flaky") == 2
        sent = log.started
        reply = await stub.Score(request("", "7", "8"), timeout=60)
        assert np.isnan(to_numpy(reply.rewards)).all() and log.started == sent  # failed fast, nothing sent
        assert all("flaky (openai " in e and "circuit breaker open (2 consecutive failures" in e
                   for e in reply.errors)
        app.state.down = False
        clock.now += 30  # open_s later: one probe goes through, succeeds, and closes the breaker
        reply = await stub.Score(request("", "7"), timeout=60)
        assert not reply.errors and to_numpy(reply.rewards)[0] == pytest.approx(1 / 9)
        assert await _health(health, "flaky") == health_pb2.HealthCheckResponse.SERVING
        assert metric("fastexp_reward_source_breaker_state", source="flaky") == 0
    finally:
        await channel.close()
        await running.stop(1)
        await composer.close()


async def test_guide_a_breaker_turned_off_keeps_its_source_serving_through_the_scorer(judge_server):
    # "`breaker: {enabled: false}` turns it off: it never opens (its state, gauge and health stay closed) and every
    # call reaches the endpoint", read through the scorer's gRPC health and the judge's own count of calls
    url, app = judge_server
    log: JudgeLog = app.state.log
    app.state.down = True
    config = JudgeConfig.model_validate(judge("unguarded", f"{url}/flaky/v1", max_attempts=1,
                                              breaker={"enabled": False, "failure_threshold": 1}))
    settings = ScorerSettings(port=0, sources=[config])
    composer = RewardComposer([JudgeScorer(config)], {"unguarded": None}, {"default": [("unguarded", 1.0)]})
    running = await start_scorer(settings, composer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub, health = scoring_pb2_grpc.ScoringServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    try:
        sent = log.started
        for _ in range(3):
            reply = await stub.Score(request("", "7"), timeout=60)
            assert "HTTP 503" in reply.errors[0] and "circuit breaker off (" in reply.errors[0], reply.errors[0]
        assert log.started - sent == 3  # every call reached the endpoint
        assert await _health(health, "unguarded") == health_pb2.HealthCheckResponse.SERVING
        assert metric("fastexp_reward_source_breaker_state", source="unguarded") == 0
    finally:
        app.state.down = False
        await channel.close()
        await running.stop(1)
        await composer.close()


@pytest.fixture(scope="module")
async def smollm2_generator(smollm2_path, tmp_path_factory):
    """A generator with tokens on, as deployments run it; its address and a file with its token."""
    token_file = tmp_path_factory.mktemp("judge-auth") / "tokens"
    token_file.write_text("judge-token\n")
    engine = HFEngine.start(smollm2_path, dtype="float32", max_model_len=512, max_batch_size=8)
    running = await start_generator(
        GeneratorSettings(port=0, max_model_len=512, auth_tokens_file=token_file), engine)
    yield f"127.0.0.1:{running.port}", token_file
    await running.stop(1)
    await engine.close()


async def test_a_judge_served_by_a_fastexp_generator(smollm2_generator):
    """SmolLM2 through the generator's Generate (its token sent), its chat template applied; a regex verdict,
    greedy."""
    address, token_file = smollm2_generator
    config = JudgeConfig(
        name="smol", backend="generator", address=address, token_file=token_file, max_new_tokens=4,
        score_range=(0, 10),
        template="Question: {prompt}\nReference answer: {reference}\nAnswer: {response}\nRate the answer from 0 "
                 "to 10. Reply with the number only.",
        verdict={"kind": "regex", "pattern": r"(\d+)"}, batch_size=8,
    )
    source = JudgeScorer(config)
    await source.start()
    try:
        items = [ScoreItem(f"What is 3 + 4? {r}", "What is 3 + 4? ", r, "", "7") for r in ("7", "12", "seven")]
        calls = metric("fastexp_reward_source_calls_total", source="smol", outcome="ok")
        result = await source.score(items, Deadline.from_remaining(240))
    finally:
        await source.close()
    assert metric("fastexp_reward_source_calls_total", source="smol", outcome="ok") - calls == 1  # one batch
    scored = ~np.isnan(result.rewards)
    assert scored.any()
    assert ((result.rewards[scored] >= 0) & (result.rewards[scored] <= 1)).all()
    assert all(error.startswith(f"smol (generator {address})") for error in result.errors if error)
    assert (result.metrics["completion_tokens"] >= 1).all() and (result.metrics["prompt_tokens"] > 20).all()


async def test_a_judge_answering_more_than_max_response_bytes_is_refused_unread():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def flood():
        async def chunks():  # 64 MiB: far past the cap
            for _ in range(1024):
                yield b" " * 65536
        return StreamingResponse(chunks(), media_type="application/json")

    with serving(app) as url:
        config = JudgeConfig.model_validate(judge("flooding", f"{url}/v1", max_response_bytes=256 * 1024,
                                                  cache={"enabled": False}))
        source = JudgeScorer(config)
        await source.start()
        try:
            result = await source.score([ScoreItem("What is 3 + 4? 7", "What is 3 + 4? ", "7", "", "7")],
                                        Deadline.from_remaining(60))
        finally:
            await source.close()
    assert np.isnan(result.rewards[0]) and "max_response_bytes (262144)" in result.errors[0], result.errors

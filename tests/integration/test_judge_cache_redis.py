"""The shared reward cache: two real scorer processes (``fastexp serve scorer``) with one judge cached in a real
``redis-server`` (started here) judge an item once between them; a Redis that is gone is a miss, never a failure."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastexp.tensor_codec import to_numpy
from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.deadlines import Deadline
from services.scorer.composition import build_source
from services.scorer.judges.config import JudgeConfig
from services.scorer.scorer import ScoreItem
from tests.support.http_servers import serving
from tests.support.judge_server import judge_app

REDIS_SERVER = "/usr/bin/redis-server"
TEMPLATE = "Question: {prompt}\nAnswer: {response}\nScore it from 0 to 9 in \\boxed{}."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free loopback port, no persistence; ready once it says so on stdout."""
    port = _free_port()
    server = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        for line in server.stdout:
            if "Ready to accept connections" in line:
                break
        else:
            pytest.fail(f"redis-server exited with {server.wait()}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture(scope="module")
def judge_server():
    app = judge_app()
    with serving(app) as url:
        yield url, app


def _judge(url: str, redis_url: str) -> dict:
    return {"type": "judge", "name": "shared", "backend": "openai", "url": f"{url}/ok/v1", "template": TEMPLATE,
            "score_range": [0, 9], "cache": {"redis_url": redis_url, "ttl_s": 600}}


@pytest.fixture(scope="module")
def scorers(tmp_path_factory, judge_server, redis_url) -> Iterator[list[str]]:
    """Two scorer processes with the same judge and Redis; their addresses once both report SERVING."""
    url, _ = judge_server
    config = tmp_path_factory.mktemp("scorers") / "scorer.yaml"
    config.write_text(yaml.safe_dump({"scorer": {"sources": [_judge(url, redis_url)]}}))
    ports = [_free_port(), _free_port()]
    processes = [subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "scorer", "--config", str(config),
                                   "--port", str(port)], cwd=Path(__file__).resolve().parents[2]) for port in ports]
    try:
        for port in ports:
            _wait_serving(f"127.0.0.1:{port}")
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(60)


def _wait_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:  # each Check waits for the process to listen; SERVING follows its sources' start
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=180, wait_for_ready=True)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return


def _score(address: str, responses: list[str]) -> scoring_pb2.ScoreResponse:
    prompt = "What is 3 + 4? "
    with grpc.insecure_channel(address) as channel:
        return scoring_pb2_grpc.ScoringServiceStub(channel).Score(
            scoring_pb2.ScoreRequest(queries=[prompt + r for r in responses], prompts=[prompt] * len(responses)),
            timeout=60,
        )


def test_two_scorer_processes_share_one_redis_cache(scorers, judge_server, redis_url):
    _, app = judge_server
    responses = ["7", "seven", "It is 7"]
    before = app.state.log.answered
    first = _score(scorers[0], responses)
    assert app.state.log.answered - before == 3
    assert list(to_numpy(first.metrics["shared/cached"])) == [0, 0, 0]
    second = _score(scorers[1], responses)  # the other process: every item from Redis, no judge call
    assert app.state.log.answered - before == 3
    assert list(to_numpy(second.metrics["shared/cached"])) == [1, 1, 1]
    assert np.array_equal(to_numpy(second.rewards), to_numpy(first.rewards))
    assert np.array_equal(to_numpy(second.metrics["shared/score"]), to_numpy(first.metrics["shared/score"]))
    client = redis.Redis.from_url(redis_url)
    keys = client.keys("fastexp:reward:*")
    assert len(keys) == 3 and all(0 < client.ttl(key) <= 600 for key in keys)


async def test_a_redis_that_is_gone_is_a_miss_not_a_failure(judge_server):
    url, app = judge_server
    config = JudgeConfig.model_validate(_judge(url, f"redis://127.0.0.1:{_free_port()}/0"))
    source = build_source(config)
    await source.start()
    try:
        before = app.state.log.answered
        items = [ScoreItem("Q 7", "Q ", "7", "", ""), ScoreItem("Q 8", "Q ", "8", "", "")]
        result = await source.score(items, Deadline.from_remaining(60))
    finally:
        await source.close()
    assert result.errors == (None, None) and app.state.log.answered - before == 2

"""Resumable streams (issue 43) on two experience replicas sharing one state store, in process (one HF generator,
tiny Llama, float32; a rule scorer). A stream opened through A and broken after its first batch is resumed through
B with what the client holds: B generates only the other groups, its batches carry the message's prompt indices and
go on with batch_index, and the running statistics (reward moments) counted every group exactly once, also the
groups A counted and never delivered. The edge: another request under a used stream_id, a malformed id or resume
field, each INVALID_ARGUMENT naming its field. The client (``ExperienceClient``) does the same by itself."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import sqlalchemy as sa

from fastexp import ExperienceClient, RequestOptions, Sampling
from fastexp.request import build_request
from fastexp.v1 import experience_pb2, experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.common import metrics
from services.experience.state.schema import scoped_statistics, streams
from tests.integration.test_lora_runs import one_thread  # noqa: F401 - the module's autouse fixture: one torch thread
from tests.integration.test_replicas_inprocess import _two_replicas
from tests.support.proxies import TcpProxy

PROMPTS = [f"What is {i} + {i}?" for i in range(6)]
N = 2
OPTIONS = RequestOptions(n_samples_per_prompt=N, micro_rollout_batch_size=N, sampling=Sampling(
    temperature=1.0, max_new_tokens=6), reward_running_norm=True, max_staleness=None)


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return {"state_url": f"sqlite:///{root / 'state.db'}", "weights_dir": root / "weights"}


@pytest.fixture(scope="module")
async def replicas(tiny_model_path, state):
    # a window of one group: A has generated at most a group or two beyond the batch its client reads
    async with _two_replicas(tiny_model_path, max_groups_ahead=1, **state) as addresses:
        yield addresses


def _open(address: str, request: experience_pb2.MakeExperiencesRequest, batches: int | None = None) -> list:
    """Stream ``request`` from ``address``; stop (cancel) after ``batches`` batches (None: to the end)."""
    with grpc.insecure_channel(address) as channel:
        call = experience_pb2_grpc.ExperienceServiceStub(channel).MakeExperiences(request, timeout=120)
        received = []
        for message in call:
            received.append(experience_from_pb(message))
            if batches is not None and len(received) == batches:
                call.cancel()
                break
        return received


def _stored(state, stream_id: str) -> tuple[set[int], int]:
    """The stream's counted groups and the reward count of its statistics, from the store itself."""
    engine = sa.create_engine(state["state_url"])
    with engine.connect() as connection:
        counted = connection.execute(sa.select(streams.c.counted).where(streams.c.stream_id == stream_id)).scalar_one()
        count = connection.execute(sa.select(scoped_statistics.c.reward_count).where(
            scoped_statistics.c.principal == "stream:anonymous", scoped_statistics.c.run_id == stream_id)).scalar_one()
    engine.dispose()
    return set(json.loads(counted)), count


async def test_a_stream_broken_on_one_replica_is_resumed_on_another_with_each_group_once(replicas, state):
    request = build_request(PROMPTS, OPTIONS)
    request.stream_id = "resume-test-1"
    first = await asyncio.to_thread(_open, replicas["A"], request, 1)
    assert [int(i) for i in first[0].prompt_index] == [0] * N and first[0].batch_index == 0
    # A may have counted more groups than it delivered before the cancel reached it
    counted_by_a, _ = _stored(state, "resume-test-1")
    assert {0} <= counted_by_a
    request.resume.CopyFrom(experience_pb2.StreamResume(delivered_prompt_indices=[0], next_batch_index=1))
    rest = await asyncio.to_thread(_open, replicas["B"], request)
    delivered = [int(i) for batch in first + rest for i in batch.prompt_index]
    assert sorted(delivered) == sorted(list(range(len(PROMPTS))) * N)  # every group, once
    assert [b.batch_index for b in rest] == list(range(1, len(rest) + 1))
    counted, reward_count = _stored(state, "resume-test-1")
    assert counted == set(range(len(PROMPTS)))
    assert reward_count == len(PROMPTS) * N  # each group's rewards once, the lost copies' included, never twice


async def test_a_resume_supersedes_the_open_still_running_elsewhere(replicas, state):
    # a network cut the serving replica has not noticed: its open holds a group at the scorer while the client
    # resumes through B; once the scorer answers, A's open finds itself superseded at its next batch and ends
    # (FAILED_PRECONDITION naming stream_id), and B's counts each group once
    gate = replicas.scorer_gate
    request = build_request(PROMPTS, OPTIONS)
    request.stream_id = "resume-test-superseded"
    gate.close(after=1)
    with grpc.insecure_channel(replicas["A"]) as channel:
        call = experience_pb2_grpc.ExperienceServiceStub(channel).MakeExperiences(request, timeout=120)
        first = experience_from_pb(await asyncio.to_thread(next, call))
        await gate.wait_held(1)  # A's open is in the middle of its next group
        resume = experience_pb2.MakeExperiencesRequest()
        resume.CopyFrom(request)
        resume.resume.CopyFrom(experience_pb2.StreamResume(
            delivered_prompt_indices=[int(first.prompt_index[0])], next_batch_index=1))
        resumed = asyncio.create_task(asyncio.to_thread(_open, replicas["B"], resume))
        await _until(lambda: _opens(state, "resume-test-superseded") == 2)  # B's open is the stream's now
        gate.open()
        with pytest.raises(grpc.RpcError) as raised:
            await asyncio.to_thread(list, call)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.details().startswith("stream_id:"), raised.value.details()
        rest = await resumed
    delivered = sorted(int(i) for batch in [first, *rest] for i in batch.prompt_index)
    assert delivered == sorted(list(range(len(PROMPTS))) * N)
    assert _stored(state, "resume-test-superseded")[1] == len(PROMPTS) * N


def _opens(state, stream_id: str) -> int:
    engine = sa.create_engine(state["state_url"])
    with engine.connect() as connection:
        opens = connection.execute(sa.select(streams.c.opens).where(streams.c.stream_id == stream_id)).scalar()
    engine.dispose()
    return opens or 0


async def test_stream_fields_are_checked_before_any_work(replicas):
    request = build_request(PROMPTS, OPTIONS)
    request.stream_id = "resume-test-2"
    await asyncio.to_thread(_open, replicas["A"], request, 1)
    other = build_request(PROMPTS[:3], OPTIONS)
    other.stream_id = "resume-test-2"
    bad_id = build_request(PROMPTS, OPTIONS)
    bad_id.stream_id = "no spaces/slashes"
    bad_index = build_request(PROMPTS, OPTIONS)
    bad_index.stream_id = "resume-test-3"
    bad_index.resume.delivered_prompt_indices.append(len(PROMPTS))
    no_id = build_request(PROMPTS, OPTIONS)
    no_id.resume.next_batch_index = 1
    cases = [(other, "stream_id"), (bad_id, "stream_id"), (bad_index, "resume.delivered_prompt_indices"),
             (no_id, "resume")]
    for message, field in cases:
        with pytest.raises(grpc.RpcError) as raised:
            await asyncio.to_thread(_open, replicas["B"], message)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(f"{field}:"), raised.value.details()


async def test_the_client_resumes_a_drained_stream_on_another_replica_by_itself(tiny_model_path, tmp_path):
    # one address for both replicas (gRPC's own resolver, A first: as a Service would route). The scorer passes
    # one group, then holds A's next: the trainer has a batch and A a stream in progress when A is told to stop
    # (grace 3 s, streams handed over at once); the scorer opens once A handed its stream over, and the client
    # resumes it on B by itself: every group arrives once, batch indices go on
    state = {"state_url": f"sqlite:///{tmp_path / 'state.db'}", "weights_dir": tmp_path / "weights"}
    async with _two_replicas(tiny_model_path, max_groups_ahead=1, drain_margin_s=3.0, **state) as replicas:
        loop, gate, drained_before = asyncio.get_running_loop(), replicas.scorer_gate, _drained()
        gate.close(after=1)

        async def stop_a() -> None:
            await gate.wait_held(1)
            stopping = asyncio.create_task(replicas.services[0].running.stop(3))
            await _until(lambda: _drained() > drained_before)  # A handed its stream over
            gate.open()
            await stopping

        def stream() -> tuple[list, dict]:
            with ExperienceClient(f"ipv4:{replicas['A']},{replicas['B']}", timeout_s=120) as client:
                batches = []
                for batch in client.make_experiences(PROMPTS, OPTIONS):
                    batches.append(batch)
                    if len(batches) == 1:
                        asyncio.run_coroutine_threadsafe(stop_a(), loop).result(60)
                return batches, client.last_stream_stats

        batches, stats = await asyncio.to_thread(stream)
    assert sorted(int(i) for b in batches for i in b.prompt_index) == sorted(list(range(len(PROMPTS))) * N)
    assert stats["resumes"] == 1
    assert [b.batch_index for b in batches] == list(range(len(batches)))


def _drained() -> float:
    return metrics.STREAMS_DRAINED._value.get()


async def test_a_replica_that_vanished_silently_is_detected_and_the_stream_resumed(tiny_model_path, tmp_path):
    # a silent partition: the proxy keeps the trainer's connection open but drops its bytes both ways (no reset,
    # no FIN); the client's keepalive (1.5 s here) finds the connection dead and resumes through the proxy, whose
    # new connection reaches the same replica: every group once, long before the stream's deadline (120 s)
    state = {"state_url": f"sqlite:///{tmp_path / 'state.db'}", "weights_dir": tmp_path / "weights"}
    async with _two_replicas(tiny_model_path, max_groups_ahead=1, **state) as replicas:
        loop, gate = asyncio.get_running_loop(), replicas.scorer_gate
        proxy = TcpProxy([replicas["A"], replicas["B"]])
        gate.close(after=1)

        async def partition() -> None:
            await gate.wait_held(1)  # A is in the middle of its next group
            assert proxy.black_hole() == 1
            gate.open()

        def stream() -> tuple[list, dict, float]:
            with ExperienceClient(proxy.address, timeout_s=120, keepalive_s=1.5) as client:
                batches, started = [], time.monotonic()
                for batch in client.make_experiences(PROMPTS, OPTIONS):
                    batches.append(batch)
                    if len(batches) == 1:
                        asyncio.run_coroutine_threadsafe(partition(), loop).result(60)
                return batches, client.last_stream_stats, time.monotonic() - started

        try:
            batches, stats, seconds = await asyncio.to_thread(stream)
        finally:
            proxy.close()
    assert sorted(int(i) for b in batches for i in b.prompt_index) == sorted(list(range(len(PROMPTS))) * N)
    assert stats["resumes"] == 1 and seconds < 60


async def _until(condition, timeout_s: float = 60.0) -> None:
    """Return once ``condition()`` holds (a metric moved), checked every 50 ms."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)

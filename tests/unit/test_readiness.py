"""The experience service's readiness: NOT_SERVING until the generator and scorer answer, SERVING after, NOT_SERVING
again while the generator is unreachable; never a start-up deadline. The probes here are small real
implementations of the two probe protocols whose reachability the test switches."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import NotReady, UpstreamTimeout
from services.experience.fleet.readiness import GeneratorInfo, ProbeSettings, UpstreamMonitor

FAST = ProbeSettings(timeout_s=0.5, interval_s=0.01, backoff_initial_s=0.01, backoff_max_s=0.05, backoff_jitter_s=0.0)


class _Generator:
    def __init__(self) -> None:
        self.reachable = False
        self.policy_version = 0
        self.calls = 0

    async def model_info(self, timeout_s: float) -> GeneratorInfo:
        self.calls += 1
        if not self.reachable:
            raise NotReady("generator: UNAVAILABLE: connection refused")
        return GeneratorInfo("tiny", "hf", 512, self.policy_version)


class _Scorer:
    def __init__(self) -> None:
        self.reachable = False

    async def check_serving(self, timeout_s: float) -> None:
        if not self.reachable:
            raise UpstreamTimeout("scorer: DEADLINE_EXCEEDED")


async def _eventually(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def watched():
    generator, scorer = _Generator(), _Scorer()
    changes: list[bool] = []
    reached: list[tuple[int, bool]] = []

    async def on_readiness(ready: bool) -> None:
        changes.append(ready)

    monitor = UpstreamMonitor(
        generator, scorer, generator_address="gen:1", scorer_address="sco:2",
        on_generator_info=lambda info, first: reached.append((info.policy_version, first)), settings=FAST,
    )
    task = asyncio.create_task(monitor.run(on_readiness))
    yield monitor, generator, scorer, changes, reached
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_not_ready_names_what_it_waits_for_until_both_answer(watched):
    monitor, generator, scorer, changes, reached = watched
    await _eventually(lambda: generator.calls >= 5)  # it keeps trying: no start-up deadline
    with pytest.raises(NotReady, match=r"the generator at gen:1 \(generator: UNAVAILABLE.*the scorer at sco:2"):
        monitor.require_ready()
    generator.reachable = True
    await _eventually(lambda: reached)
    assert not monitor.ready
    with pytest.raises(NotReady) as raised:
        monitor.require_ready()
    assert "scorer at sco:2" in str(raised.value) and "generator at" not in str(raised.value)
    scorer.reachable = True
    assert (await monitor.wait_ready(5)).max_model_len == 512
    assert changes == [True] and reached == [(0, True)]


async def test_a_generator_that_goes_away_turns_it_not_serving_until_it_is_back(watched):
    monitor, generator, scorer, changes, reached = watched
    generator.reachable = scorer.reachable = True
    await monitor.wait_ready(5)
    generator.reachable = False
    await _eventually(lambda: not monitor.ready)
    with pytest.raises(NotReady, match="generator at gen:1"):
        monitor.require_ready()
    generator.policy_version = 0
    generator.reachable = True
    await monitor.wait_ready(5)
    assert changes == [True, False, True]
    assert reached == [(0, True), (0, False)]  # told again when it comes back, as not the first contact


async def test_the_scorer_gates_readiness_only_until_first_reached(watched):
    """Reward teams swap scorer containers while training runs; Score calls retry, so a swap keeps SERVING."""
    monitor, generator, scorer, changes, _ = watched
    generator.reachable = scorer.reachable = True
    await monitor.wait_ready(5)
    scorer.reachable = False
    calls = generator.calls
    await _eventually(lambda: generator.calls >= calls + 5)
    assert monitor.ready and changes == [True]


async def test_wait_ready_times_out_saying_what_it_waits_for(watched):
    monitor, *_ = watched
    with pytest.raises(TimeoutError, match="waiting .* for the generator at gen:1"):
        await monitor.wait_ready(0.1)


async def test_an_unexpected_probe_error_does_not_end_the_watch():
    class Broken(_Generator):
        async def model_info(self, timeout_s: float) -> GeneratorInfo:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("a bug in a probe")
            return await super().model_info(timeout_s)

    generator, scorer = Broken(), _Scorer()
    generator.reachable = scorer.reachable = True
    monitor = UpstreamMonitor(generator, scorer, generator_address="g", scorer_address="s",
                              settings=ProbeSettings(**{**FAST.__dict__, "backoff_max_s": 0.01}))
    task = asyncio.create_task(monitor.run())
    try:
        assert (await monitor.wait_ready(5)).model_name == "tiny" and generator.calls >= 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_readiness_holds_only_while_every_condition_does():
    from grpc_health.v1 import health, health_pb2

    from services.common.server import RunningServer, ServingGate

    servicer = health.aio.HealthServicer()
    running = RunningServer(server=None, port=0, health=servicer, service_names=("fastexp.v1.ExperienceService",))
    gate = ServingGate(running, ("upstream", "state store"), initially=("state store",))

    async def status() -> int:
        request = health_pb2.HealthCheckRequest(service="")
        return (await servicer.Check(request, None)).status

    await gate.setter("upstream")(True)
    assert await status() == health_pb2.HealthCheckResponse.SERVING
    await gate.setter("state store")(False)  # the database stopped answering
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    await gate.setter("upstream")(True)  # the other condition alone does not make it ready
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    await gate.setter("state store")(True)
    assert await status() == health_pb2.HealthCheckResponse.SERVING


async def test_a_call_waits_for_readiness_that_lags_its_dependency_not_for_the_backoff():
    """A replica following another replica's update is NOT_SERVING for a moment; a stream arriving then waits for it
    (``ready_info``), and the wait asks for a probe at once: with an hour of backoff, it is served all the same."""
    generator, scorer = _Generator(), _Scorer()
    scorer.reachable = True
    slow = ProbeSettings(timeout_s=0.5, interval_s=3600.0, backoff_initial_s=3600.0, backoff_max_s=3600.0,
                         backoff_jitter_s=0.0)
    monitor = UpstreamMonitor(generator, scorer, generator_address="gen:1", scorer_address="sco:2", settings=slow)
    task = asyncio.create_task(monitor.run())
    try:
        await _eventually(lambda: generator.calls >= 1)  # refused once: the next probe is an hour away
        with pytest.raises(NotReady, match="the generator at gen:1"):
            await monitor.ready_info(0.05)  # not ready within the wait: refused, naming what it waits for
        generator.reachable = True
        assert (await asyncio.wait_for(monitor.ready_info(30.0), 5)).max_model_len == 512
        assert monitor.ready
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

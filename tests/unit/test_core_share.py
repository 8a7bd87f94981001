"""The split of a CPU host's cores between a generator's engine and the forward passes
(:class:`services.experience.fleet.cores.CoreShare`): the engine is shrunk before a pass runs, stays shrunk while
passes queue, and is lent every core back once none waits; engines that cannot adjust are left alone. The replicas
here record the SetCpuThreads calls they get; the real call is exercised end to end in tests/e2e/test_smollm2.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.common.errors import FailedPrecondition
from services.experience.fleet.cores import CoreShare
from services.experience.fleet.readiness import GeneratorInfo


class _Engine:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[int] = []
        self.changed = asyncio.Event()
        self.fail = fail

    async def set_cpu_threads(self, threads: int, timeout_s: float) -> int:
        self.calls.append(threads)
        self.changed.set()
        if self.fail:
            raise FailedPrecondition("SetCpuThreads: not adjustable")
        return threads or 2


@dataclass
class _Replica:
    address: str
    client: _Engine
    info: GeneratorInfo | None


@dataclass
class _Fleet:
    replicas: tuple[_Replica, ...]
    in_flight: int = 0
    members: object = field(init=False)

    def __post_init__(self) -> None:
        self.members = self

    def routable(self, replica: _Replica) -> bool:
        return True

    def samples_in_flight(self) -> int:
        return self.in_flight


def _info(max_cpu_threads: int) -> GeneratorInfo:
    return GeneratorInfo("m", "vllm", 512, 0, max_cpu_threads=max_cpu_threads)


async def _grown(engine: _Engine) -> None:
    async with asyncio.timeout(5):
        while engine.calls[-1:] != [0]:
            engine.changed.clear()
            await engine.changed.wait()


async def test_the_engine_is_shrunk_before_a_pass_and_grown_once_no_pass_waits():
    engine = _Engine()
    fleet = _Fleet((_Replica("a", engine, _info(2)),), in_flight=8)
    share = CoreShare(fleet, engine_threads_sharing=1, forward_threads=1, idle_forward_threads=2)
    with share.waiting():
        assert await share.threads() == 1  # generation in flight: the forwards' half
        assert engine.calls == [1]  # shrunk before the pass was given its threads
        with share.waiting():  # a second pass queued behind the first: nothing changes between them
            pass
        assert await share.threads() == 1 and engine.calls == [1]
    await _grown(engine)
    assert engine.calls == [1, 0]
    fleet.in_flight = 0
    with share.waiting():
        assert await share.threads() == 2  # nothing generating: every core to the pass
        assert engine.calls == [1, 0, 1]
    await _grown(engine)
    await share.close()


@pytest.mark.parametrize("max_cpu_threads", [0, 2])
async def test_engines_that_cannot_adjust_are_left_alone_and_a_refusal_does_not_hold_a_pass(max_cpu_threads):
    engine = _Engine(fail=True)
    fleet = _Fleet((_Replica("a", engine, _info(max_cpu_threads)),), in_flight=1)
    share = CoreShare(fleet, engine_threads_sharing=1, forward_threads=1, idle_forward_threads=2)
    for _ in range(2):
        with share.waiting():
            assert await share.threads() == 1
    await share.close()
    # an engine reporting no adjustable threads is never called; one that refuses is asked once per change
    assert engine.calls == ([] if max_cpu_threads == 0 else [1, 0, 1][: len(engine.calls)])


async def test_without_sharing_only_the_forwards_threads_follow_generation():
    engine = _Engine()
    fleet = _Fleet((_Replica("a", engine, _info(2)),), in_flight=0)
    share = CoreShare(fleet, forward_threads=1, idle_forward_threads=2)
    with share.waiting():
        assert await share.threads() == 2
        fleet.in_flight = 3
        assert await share.threads() == 1
    await share.close()
    assert engine.calls == []

"""Tenants share the tool sandbox: episodes started by the experience service's own ``EnvironmentClient`` with the
run's id as ``StartEpisodeRequest.tenant``, through the real scorer's ``EnvironmentService`` (``python_tool``) on real
bubblewrap. One run's backlog of tool calls does not hold another run's call behind it, and a per-tenant cap keeps a
slot for a run that comes later.

Order is observed through events: a run is under way when its ``sleep`` process (a marker in its command line) is on
the host; a call is queued when the sandbox's slots log that its tenant waits; a slot is freed by ending the
episode whose step holds it (its run is killed and reaped before EndEpisode answers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import grpc
import pytest

from services.common.deadlines import Deadline
from services.experience.fleet.clients import EnvironmentClient
from services.scorer.sandbox import SandboxSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.integration.test_tool_sandbox import _call, _environments, _host_processes_with, _until

SLOTS_LOGGER = "services.scorer.sandbox.slots"


@contextlib.asynccontextmanager
async def _scorer(sandbox: SandboxSettings):
    settings = ScorerSettings(port=0, environment_workers=1, environments=_environments(), sandbox=sandbox)
    core = build_scorer(settings)
    running = await start_scorer(settings, core)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield EnvironmentClient(channel, timeout_s=120.0)
    finally:
        await channel.close()
        await running.server.stop(0)
        await core.close()


class Calls:
    """Tool calls, one episode each, for named tenants."""

    def __init__(self, client: EnvironmentClient) -> None:
        self.client = client
        self.sessions: list[str] = []
        self.steps: list[asyncio.Task] = []

    async def call(self, tenant: str, code: str) -> tuple[str, asyncio.Task]:
        """Start an episode for ``tenant`` and its one step running ``code``; returns (session, the step)."""
        session, _, _ = await self.client.start("python_tool", "p", "1", "", 4, Deadline.from_remaining(60), tenant)
        self.sessions.append(session)
        step = asyncio.create_task(self.client.step(session, _call(code), Deadline.from_remaining(600)))
        self.steps.append(step)
        return session, step

    async def sleeper(self, tenant: str) -> tuple[str, asyncio.Task, str]:
        marker = f"3600.{secrets.randbelow(10**6):06d}7"
        session, step = await self.call(tenant, f"import os\nos.execvp('sleep', ['sleep', {marker!r}])")
        return session, step, marker

    async def end_all(self) -> None:
        """End every episode (their runs are killed and reaped first) and wait for every step to end."""
        for session in self.sessions:
            await self.client.end(session)
        await asyncio.gather(*self.steps, return_exceptions=True)


def _waiting(caplog, tenant: str) -> int:
    return sum(r.name == SLOTS_LOGGER and r.getMessage().startswith(f"tenant {tenant!r} waits") for r in caplog.records)


async def test_a_runs_call_goes_before_another_runs_backlog(caplog):
    caplog.set_level(logging.DEBUG, logger=SLOTS_LOGGER)
    async with _scorer(SandboxSettings(max_concurrent=1)) as client:
        calls = Calls(client)
        first, _, first_marker = await calls.sleeper("run-a")
        await _until(lambda: _host_processes_with(first_marker), 60)  # run-a holds the only slot
        backlog = [await calls.sleeper("run-a") for _ in range(2)]
        await _until(lambda: _waiting(caplog, "run-a") == 2, 60)  # and two more of its calls wait
        _, other = await calls.call("run-b", "print('run-b answered')")
        await _until(lambda: _waiting(caplog, "run-b") == 1, 60)  # run-b's call came last
        await client.end(first)  # run-a's run ends: the slot goes to run-b, which holds none, not to run-a's backlog
        async with asyncio.timeout(60):  # one queue would run a sleep of an hour first
            answer = await other
        assert answer.observation.strip() == "run-b answered"
        await _until(lambda: _host_processes_with(backlog[0][2]), 60)  # then run-a's backlog, in its order
        assert not _host_processes_with(backlog[1][2])
        await calls.end_all()
        assert not any(_host_processes_with(marker) for _, _, marker in backlog)


async def test_a_tenants_cap_keeps_a_slot_for_another_run(caplog):
    caplog.set_level(logging.DEBUG, logger=SLOTS_LOGGER)
    async with _scorer(SandboxSettings(max_concurrent=2, max_concurrent_per_tenant=1)) as client:
        calls = Calls(client)
        _, _, marker = await calls.sleeper("run-a")
        await _until(lambda: _host_processes_with(marker), 60)
        _, _, queued = await calls.sleeper("run-a")
        await _until(lambda: _waiting(caplog, "run-a") == 1, 60)  # a free slot, but not for run-a
        _, other = await calls.call("run-b", "print('run-b answered')")
        async with asyncio.timeout(60):  # run-b does not wait for run-a's hour-long runs
            answer = await other
        assert answer.observation.strip() == "run-b answered" and _waiting(caplog, "run-b") == 0
        assert _host_processes_with(marker) and not _host_processes_with(queued)
        await calls.end_all()
        assert not _host_processes_with(marker) and not _host_processes_with(queued)


@pytest.mark.parametrize("tenant", ["x" * 257])
async def test_a_tenant_past_its_bound_is_refused_naming_the_field(tenant):
    from services.common.errors import InvalidRequest

    async with _scorer(SandboxSettings()) as client:
        with pytest.raises(InvalidRequest, match="tenant"):
            await client.start("python_tool", "p", "1", "", 4, Deadline.from_remaining(60), tenant)

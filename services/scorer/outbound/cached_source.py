"""A reward source behind a cache: items already scored (in the cache, or earlier in the same request) are not
sent again. Only rewards are stored; failures are always retried on the next request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.deadlines import Deadline
from services.common.metrics import SOURCE_CACHE_LOOKUPS
from services.scorer.outbound.cache import CachedReward, RewardCache, cache_key
from services.scorer.scorer import NO_DEADLINE, RewardSource, ScoreItem, SourceScores

#: Per-item metric: 1 when the reward came from the cache or an identical item of the same request, else 0.
CACHED_METRIC = "cached"


class CachingSource:
    """:class:`~services.scorer.scorer.RewardSource` wrapping ``inner`` with ``cache`` under ``fingerprint``.

    Metrics: ``fastexp_reward_source_cache_lookups_total{result=hit|shared|miss|error}`` per item, and the per-item
    ``cached`` metric (0/1) in the source's columns.
    """

    def __init__(self, inner: RewardSource, cache: RewardCache, fingerprint: str) -> None:
        self.name = inner.name
        self.inner = inner
        self._cache = cache
        self._fingerprint = fingerprint

    @property
    def breaker(self):
        """The inner source's breaker, if it has one."""
        return getattr(self.inner, "breaker", None)

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()
        await self._cache.close()

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Rewards for ``items``: cached ones from the cache, the rest (each distinct item once) from ``inner``."""
        keys = [cache_key(self._fingerprint, i.prompt, i.response, i.reference, i.label) for i in items]
        distinct = list(dict.fromkeys(keys))
        found = dict(zip(distinct, await self._cache.get_many(distinct), strict=True))
        errored = getattr(self._cache, "failures", 0)
        misses = [key for key in distinct if found[key] is None]
        first = {}
        for index, key in enumerate(keys):
            first.setdefault(key, index)
        scored = await self.inner.score([items[first[key]] for key in misses], deadline) if misses else None
        fresh: dict[str, tuple[float, dict[str, float], str | None]] = {}
        if scored is not None:
            for row, key in enumerate(misses):
                metrics = {name: float(values[row]) for name, values in scored.metrics.items()}
                fresh[key] = (float(scored.rewards[row]), metrics, scored.errors[row])
            await self._cache.put_many({
                key: CachedReward(reward, metrics) for key, (reward, metrics, error) in fresh.items() if error is None
            })
        self._count(keys, found, first, errored != getattr(self._cache, "failures", 0))
        return _assemble(keys, found, fresh, first)

    def _count(self, keys: list[str], found: dict, first: dict[str, int], cache_failed: bool) -> None:
        lookups = SOURCE_CACHE_LOOKUPS
        for index, key in enumerate(keys):
            if found[key] is not None:
                lookups.labels(self.name, "hit").inc()
            elif first[key] != index:
                lookups.labels(self.name, "shared").inc()
            else:
                lookups.labels(self.name, "error" if cache_failed else "miss").inc()


def _assemble(keys: list[str], found: dict[str, CachedReward | None],
              fresh: dict[str, tuple[float, dict[str, float], str | None]], first: dict[str, int]) -> SourceScores:
    """One row per key, from the cache or the fresh answers (metrics' union; NaN where an entry lacks one)."""
    n = len(keys)
    names = sorted({name for entry in found.values() if entry for name in entry.metrics}
                   | {name for _, metrics, _ in fresh.values() for name in metrics} - {CACHED_METRIC})
    rewards = np.full(n, np.nan, np.float32)
    metrics = {name: np.full(n, np.nan, np.float32) for name in names}
    cached = np.zeros(n, np.float32)
    errors: list[str | None] = [None] * n
    for index, key in enumerate(keys):
        entry = found[key]
        if entry is not None:
            reward, values, error = entry.reward, entry.metrics, None
            cached[index] = 1.0
        else:
            reward, values, error = fresh[key]
            cached[index] = float(first[key] != index and error is None)
        rewards[index], errors[index] = reward, error
        for name in names:
            metrics[name][index] = values.get(name, np.nan)
    metrics[CACHED_METRIC] = cached
    return SourceScores(rewards, metrics, tuple(errors))

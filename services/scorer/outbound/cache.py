"""Content-addressed reward caches: keys (pure), a local LRU (cachetools) and a shared one in Redis (redis-py's
asyncio client).

A key is the SHA-256 of the source's configuration fingerprint and the item's (prompt, response, reference, label);
the fingerprint covers what decides a reward (endpoint, model, template, verdict, ranges, sampling, the cache's
``version``) and leaves out what does not (name, budget, breaker, timeouts). A value is the reward and the source's
per-item metrics. A Redis that is down or slow (past ``timeout_s``) is a miss, never an error of the items.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachetools import LRUCache, TTLCache
from pydantic import BaseModel

from services.scorer.outbound.config import CacheConfig

logger = logging.getLogger(__name__)

#: Configuration fields that never change a reward (left out of the fingerprint).
OPERATIONAL_FIELDS = frozenset({
    "name", "fallback_reward", "budget", "breaker", "cache", "timeout_s", "max_attempts", "backoff_initial_s",
    "backoff_max_s", "max_concurrency", "batch_size", "headers", "max_response_bytes", "requests_per_minute",
    "token_file", "tls_ca_file", "tls_cert_file", "tls_key_file",
})
#: Redis keys: this prefix, then the hex key.
REDIS_PREFIX = "fastexp:reward:"
#: Redis entries' lifetime when ``ttl_s`` is unset (seconds).
REDIS_DEFAULT_TTL_S = 86400


def fingerprint(config: BaseModel, version: str = "") -> str:
    """SHA-256 (hex) of a source configuration's reward-deciding fields and the cache ``version`` (module docs)."""
    fields = config.model_dump(mode="json", exclude=set(OPERATIONAL_FIELDS))
    return hashlib.sha256(json.dumps([fields, version], sort_keys=True).encode()).hexdigest()


def cache_key(fingerprint_hex: str, prompt: str, response: str, reference: str, label: str) -> str:
    """SHA-256 (hex) of one item under one source configuration (module docs)."""
    payload = json.dumps([fingerprint_hex, prompt, response, reference, label], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class CachedReward:
    """A scored item: its reward and the source's metrics for it (NaN where not measured)."""

    reward: float
    metrics: Mapping[str, float]

    def to_json(self) -> str:
        return json.dumps({"reward": self.reward, "metrics": dict(self.metrics)})

    @staticmethod
    def from_json(text: str | bytes) -> CachedReward | None:
        """The entry, or None when ``text`` is not one (a foreign or corrupt value is a miss)."""
        try:
            body = json.loads(text)
            reward = float(body["reward"])
            metrics = {str(k): float(v) for k, v in dict(body.get("metrics", {})).items()}
        except (ValueError, TypeError, KeyError):
            return None
        return CachedReward(reward, metrics) if math.isfinite(reward) else None


class RewardCache(Protocol):
    """Where a source's rewards are kept between requests."""

    async def get_many(self, keys: Sequence[str]) -> list[CachedReward | None]:
        """The entries of ``keys`` (None: a miss). Never raises for the cache's own failures: those are misses."""
        ...

    async def put_many(self, entries: Mapping[str, CachedReward]) -> None:
        """Store ``entries``. Never raises for the cache's own failures."""
        ...

    async def close(self) -> None: ...


class LocalCache:
    """An in-process LRU of ``max_entries`` entries (cachetools), each valid ``ttl_s`` seconds when set."""

    shared = False

    def __init__(self, config: CacheConfig) -> None:
        self._entries: LRUCache = (
            TTLCache(config.max_entries, config.ttl_s) if config.ttl_s else LRUCache(config.max_entries)
        )

    async def get_many(self, keys: Sequence[str]) -> list[CachedReward | None]:
        return [self._entries.get(key) for key in keys]

    async def put_many(self, entries: Mapping[str, CachedReward]) -> None:
        self._entries.update(entries)

    async def close(self) -> None:
        self._entries.clear()


class RedisCache:
    """A cache shared by every scorer replica on one Redis (``MGET``, then ``SET ... EX`` in one pipeline), each
    call bounded by ``timeout_s``. Entries expire after ``ttl_s`` (1 day when unset)."""

    shared = True

    def __init__(self, config: CacheConfig) -> None:
        from redis.asyncio import Redis

        assert config.redis_url is not None
        self._url = config.redis_url
        self._ttl_s = int(math.ceil(config.ttl_s or REDIS_DEFAULT_TTL_S))
        self._client = Redis.from_url(
            config.redis_url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
        )
        self.failures = 0  # calls that failed (counted as misses)

    async def get_many(self, keys: Sequence[str]) -> list[CachedReward | None]:
        if not keys:
            return []
        try:
            values = await self._client.mget([REDIS_PREFIX + key for key in keys])
        except Exception as error:  # noqa: BLE001 - a cache that fails is a miss
            self._failed("MGET", error)
            return [None] * len(keys)
        return [None if value is None else CachedReward.from_json(value) for value in values]

    async def put_many(self, entries: Mapping[str, CachedReward]) -> None:
        if not entries:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, entry in entries.items():
                    pipe.set(REDIS_PREFIX + key, entry.to_json(), ex=self._ttl_s)
                await pipe.execute()
        except Exception as error:  # noqa: BLE001 - a cache that fails is skipped
            self._failed("SET", error)

    def _failed(self, what: str, error: Exception) -> None:
        self.failures += 1
        logger.warning("reward cache %s: %s failed (%s: %s); scoring without it", self._url, what,
                       type(error).__name__, error)

    async def close(self) -> None:
        await self._client.aclose()


def build_cache(config: CacheConfig) -> LocalCache | RedisCache | None:
    """The cache ``config`` describes (None when disabled); Redis is not contacted until first use."""
    if not config.enabled:
        return None
    return RedisCache(config) if config.redis_url else LocalCache(config)

"""Per-source budgets, circuit breakers and caches, as a reward team configures them (records only; no I/O).

A networked source (``remote``, ``judge``) takes each as a nested section of its YAML entry::

    budget: {max_concurrency: 8, requests_per_minute: 600, tokens_per_minute: 200000}
    breaker: {failure_threshold: 5, open_s: 30, half_open_probes: 1}
    cache: {max_entries: 100000, ttl_s: 86400, redis_url: redis://cache:6379/0}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BudgetConfig(BaseModel):
    """How much of an endpoint one scorer replica may use. Calls over budget wait (within the request's deadline),
    they do not fail; a call still waiting when the deadline passes fails its items with DEADLINE_EXCEEDED's
    reason. Rates are token buckets (aiolimiter's leaky bucket): up to the per-minute figure at once, then refilled
    evenly over the minute."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrency: int = Field(4, ge=1, description="calls in flight at once")
    requests_per_minute: float | None = Field(None, gt=0, description="calls per minute; None: unlimited")
    tokens_per_minute: float | None = Field(
        None, gt=0, description="judge tokens per minute (prompt estimate + max_new_tokens per call); None: unlimited"
    )


class BreakerConfig(BaseModel):
    """A circuit breaker on the source's endpoint: ``failure_threshold`` consecutive failed calls (timeouts,
    connection errors, 5xx) open it; while open, the source's items fail at once naming the breaker; after
    ``open_s`` seconds up to ``half_open_probes`` calls go through, and the first success closes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false: never open")
    failure_threshold: int = Field(5, ge=1, description="consecutive failed calls that open the breaker")
    open_s: float = Field(30.0, gt=0, description="seconds open before half-open probes are let through")
    half_open_probes: int = Field(1, ge=1, description="calls in flight at once while half-open")


class CacheConfig(BaseModel):
    """A content-addressed cache of the source's rewards, keyed by (prompt, response, reference, label) and the
    source's configuration (:func:`services.scorer.outbound.cache.fingerprint`). Local (an LRU of ``max_entries``
    in the scorer process) unless ``redis_url`` is set: then every scorer replica pointing at that Redis shares it,
    each entry expiring after ``ttl_s`` (size it with the server's ``maxmemory``; see docs/reward-teams/judges.md).
    Only rewards are cached, never failures."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false: every item is scored anew")
    max_entries: int = Field(100_000, ge=1, description="local cache: entries kept (least recently used go first)")
    ttl_s: float | None = Field(None, gt=0, description="seconds an entry is valid; None: local forever, Redis 1 day")
    redis_url: str | None = Field(
        None, pattern=r"^rediss?://", description="shared cache, e.g. redis://cache:6379/0; None: local"
    )
    timeout_s: float = Field(0.5, gt=0, description="deadline of one Redis call; past it the items are scored anew")
    version: str = Field("", description="part of every key: change it to start a fresh cache (e.g. new weights)")


#: A remote reward model's cache is off unless configured (a judge's is on).
CACHE_OFF = CacheConfig(enabled=False)

"""Remote HTTP reward models, spoken to in OpenRLHF's reward-server protocol through httpx (async, pooled).

Request (POST, JSON): ``{"query": [prompt + response texts, special tokens kept], "prompts": [...],
"labels": [...], "references": [...]}``, ``batch_size`` queries at a time. When some query's prompt has images or
videos, the request also has ``"images": [[base64 string per image] per query]`` and (for videos)
``"videos": [[[base64 string per frame] per video] per query]``: each image (frame) is its own standard base64
string of the encoded file the trainer sent (PNG/JPEG), never a concatenation. Response: ``{"rewards": [N numbers],
"scores": [N numbers]?, "extra_logs": {name: [N numbers] | number}?, "errors": [N str | null]?}``; ``scores``
and ``extra_logs`` become metrics, ``errors`` (a fastexp extension) explains items whose reward is ``null``.

Bounds, per HTTP request: ``timeout_s`` is the total time for connecting, sending and reading the whole answer (a
server that trickles bytes is cut off, not just one that stalls a read), and the answer body is read as a stream
and dropped past ``max_response_bytes``.

Faults, per batch: timeouts, connection errors, HTTP 5xx and 429 are retried with capped exponential backoff and
jitter (stamina) up to ``max_attempts`` tries, and a batch whose last try failed so (or timed out at the caller's
deadline, leaving no time for another) is one failed call to the breaker; any other HTTP 4xx, and an answer over
``max_response_bytes``, is not retried and is not an outage (``rejected``); a body that is not JSON, has no
``rewards`` list or the wrong number of rewards fails the batch's items; a reward that is null, NaN or ±inf fails
that item. Retries, breaker and budget are the judges' (:class:`~services.scorer.outbound.guard.CallGuard`), so
docs/reward-teams/judges.md holds for both.
Every error names the source and the URL. At most ``max_concurrency`` requests are in flight per endpoint, at most
``requests_per_minute`` start per minute (more wait within the caller's deadline), and a circuit breaker
(``breaker``) refuses requests while the endpoint is down, failing the items at once with the breaker named
(:mod:`services.scorer.outbound`). Cancelling ``score`` closes its requests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from services.common.bodies import ACCEPT_ENCODING, ReplyTooLarge, read_capped
from services.common.deadlines import Deadline
from services.common.errors import UpstreamTimeout
from services.common.metrics import REMOTE_REWARD_FAILURES, REMOTE_REWARD_REQUESTS, REMOTE_REWARD_RETRIES
from services.scorer.config import RemoteConfig
from services.scorer.outbound.breaker import Breaker, BreakerOpen
from services.scorer.outbound.config import BudgetConfig
from services.scorer.outbound.guard import CallGuard, SourceRejected, SourceUnavailable, after_tries
from services.scorer.outbound.tls import client_tls
from services.scorer.scorer import NO_DEADLINE, ScoreItem, SourceScores, checked_rewards

logger = logging.getLogger(__name__)


def _base64(data: bytes) -> str:
    """One encoded image as a standard (RFC 4648, padded) base64 string."""
    return base64.b64encode(data).decode("ascii")


class _TotalTimeout(httpx.TimeoutException):
    """The whole exchange took longer than ``timeout_s`` (retried as httpx's own timeouts are)."""


@dataclass(frozen=True)
class _Reply:
    """An HTTP answer read whole (within the size cap)."""

    status_code: int
    content: bytes

    @property
    def is_error(self) -> bool:
        return self.status_code >= 400

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> object:
        """The body parsed. Raises ValueError: not JSON."""
        return json.loads(self.content)


class RemoteScorer:
    """A :class:`~services.scorer.scorer.RewardSource` posting to one HTTP reward endpoint (see module docs)."""

    def __init__(self, config: RemoteConfig) -> None:
        self.name = config.name
        self._config = config
        self._where = f"{config.name} ({config.url})"
        self._client: httpx.AsyncClient | None = None
        budget = BudgetConfig(max_concurrency=config.max_concurrency, requests_per_minute=config.requests_per_minute)
        self._gateway = CallGuard(config.name, budget, config.breaker)

    @property
    def breaker(self) -> Breaker:
        """This endpoint's circuit breaker (its one owner is this source)."""
        return self._gateway.breaker

    async def start(self) -> None:
        """Open the connection pool (the endpoint is not contacted: it may start after the scorer)."""
        limits = httpx.Limits(
            max_connections=self._config.max_concurrency, max_keepalive_connections=self._config.max_concurrency
        )
        verify = client_tls(self._config.tls_ca_file, self._config.tls_cert_file, self._config.tls_key_file,
                            f"{self._config.name}.tls_")
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._config.timeout_s), limits=limits, verify=verify,
            headers={"Accept-Encoding": ACCEPT_ENCODING, **self._config.headers},
        )

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Post the items in batches of ``batch_size`` (concurrently, bounded) and join the answers in order.

        Each HTTP request's timeout is ``timeout_s`` capped by ``deadline``; retries stop when it passes.
        """
        size = self._config.batch_size
        parts = await asyncio.gather(
            *(self._score_batch(items[i : i + size], deadline) for i in range(0, len(items), size))
        )
        failed = sum(1 for part in parts for error in part.errors if error)
        if failed:
            REMOTE_REWARD_FAILURES.labels(self._config.name).inc(failed)
        return SourceScores.joined(parts)

    async def _score_batch(self, items: Sequence[ScoreItem], deadline: Deadline) -> SourceScores:
        n = len(items)
        payload = {
            "query": [item.query for item in items],
            "prompts": [item.prompt for item in items],
            "labels": [item.label for item in items],
            "references": [item.reference for item in items],
        }
        if any(item.images for item in items):
            payload["images"] = [[_base64(image) for image in item.images] for item in items]
        if any(item.videos for item in items):
            payload["videos"] = [[[_base64(frame) for frame in video] for video in item.videos] for item in items]
        try:
            response = await self._post(payload, deadline)
        except BreakerOpen as error:
            return SourceScores.all_failed(n, f"{self._where}: {error}")
        except UpstreamTimeout as error:  # queued for the budget, or no time to send a try
            return SourceScores.all_failed(n, f"{self._where}: the caller's deadline passed before an answer ({error})")
        except SourceUnavailable as error:
            return SourceScores.all_failed(n, f"{self._where}: {error} ({after_tries(error)}; "
                                              f"{self._gateway.describe()})")
        except SourceRejected as error:
            return SourceScores.all_failed(n, f"{self._where}: {error}")
        try:
            body = response.json()
        except ValueError:
            return SourceScores.all_failed(n, f"{self._where}: response is not JSON: {response.text[:100]!r}")
        if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
            return SourceScores.all_failed(n, f"{self._where}: response has no 'rewards' list")
        rewards, errors = checked_rewards(self._where, body["rewards"], n)
        reported = body.get("errors")
        if isinstance(reported, list) and len(reported) == n:
            errors = [f"{self._where}: {reported[i]}" if errors[i] and reported[i] else errors[i] for i in range(n)]
        return SourceScores(rewards, self._metrics(body, n), tuple(errors))

    async def _post(self, payload: dict, deadline: Deadline) -> _Reply:
        """The batch's call: up to ``max_attempts`` tries within ``deadline``, through the breaker and budget.

        Raises:
            SourceUnavailable: the last try failed (or the deadline left no time for another). SourceRejected: 4xx
                other than 429, or an answer over ``max_response_bytes``. BreakerOpen, UpstreamTimeout: nothing sent.
        """
        config = self._config
        tries = 0

        async def send(timeout_s: float) -> _Reply:
            nonlocal tries
            tries += 1
            if tries > 1:
                REMOTE_REWARD_RETRIES.labels(config.name).inc()
            return await self._try(payload, timeout_s, tries)

        return await self._gateway.call(
            send, tokens=0, deadline=deadline, timeout_s=config.timeout_s, max_attempts=config.max_attempts,
            backoff_initial_s=config.backoff_initial_s, backoff_max_s=config.backoff_max_s,
        )

    async def _try(self, payload: dict, timeout_s: float, number: int) -> _Reply:
        """One POST within ``timeout_s`` seconds, counted in ``fastexp_remote_reward_requests_total``.

        Raises:
            SourceUnavailable: timeout, connection error, HTTP 5xx or 429. SourceRejected: another 4xx, or an
                answer over ``max_response_bytes``.
        """
        config, requests = self._config, REMOTE_REWARD_REQUESTS
        try:
            response = await self._exchange(payload, timeout_s)
        except httpx.TimeoutException as error:
            requests.labels(config.name, "timeout").inc()
            raise SourceUnavailable(str(error) or type(error).__name__, timeout=True) from None
        except httpx.TransportError as error:
            requests.labels(config.name, "error").inc()
            raise SourceUnavailable(f"{type(error).__name__}: {error}") from None
        except ReplyTooLarge as error:  # it answered, with more than a batch of rewards can be: not an outage
            requests.labels(config.name, "error").inc()
            raise SourceRejected(str(error)) from None
        requests.labels(config.name, "error" if response.is_error else "ok").inc()
        if response.status_code >= 500 or response.status_code == 429:
            logger.warning("%s: HTTP %d (try %d)", self._where, response.status_code, number)
            raise SourceUnavailable(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.is_error:
            raise SourceRejected(f"HTTP {response.status_code}: {response.text[:200]}")
        return response

    async def _exchange(self, payload: dict, timeout_s: float) -> _Reply:
        """One POST and its whole answer within ``timeout_s`` seconds in total, body capped.

        Raises:
            _TotalTimeout: past ``timeout_s``. ReplyTooLarge: see :func:`~services.common.bodies.read_capped`. httpx.TransportError.
        """
        assert self._client is not None, "start() first"
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client.stream("POST", self._config.url, json=payload, timeout=timeout_s) as response:
                    return _Reply(response.status_code, await read_capped(response, self._config.max_response_bytes))
        except TimeoutError:
            raise _TotalTimeout(f"Timeout: no whole answer within {timeout_s:.2f} s (timeout_s is the total per "
                                "request)") from None

    def _metrics(self, body: dict, n: int) -> dict[str, np.ndarray]:
        """``scores`` as metric ``score`` and each usable ``extra_logs`` entry (N numbers, or one broadcast)."""
        columns = {"score": body.get("scores")} if body.get("scores") is not None else {}
        extra = body.get("extra_logs")
        if isinstance(extra, dict):
            columns.update({str(k): v for k, v in extra.items()})
        metrics = {}
        for name, value in columns.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = [value] * n
            if isinstance(value, list) and len(value) == n:
                metrics[name] = np.array(
                    [v if isinstance(v, int | float) and not isinstance(v, bool) else math.nan for v in value],
                    dtype=np.float32,
                )
            else:
                logger.warning("%s: ignoring metric %r (not %d numbers)", self._where, name, n)
        return metrics

    async def close(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()

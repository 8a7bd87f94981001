"""Readiness of the experience service: the generator and scorer it depends on, watched for as long as it runs.

The service starts serving at once and reports NOT_SERVING over gRPC health until it has reached the generator
(its model info: the model length and policy version requests are validated against) and the scorer. It never
gives up: a dependency that is late (a vLLM engine on a cold page cache, a GPU node still pulling its image,
containers started in any order) is probed again with capped exponential backoff and jitter for as long as
the service runs (the watch loop is a loop, not a retried call: it never ends). Once both have answered it turns
SERVING; while no generator replica serves (the generator is the fleet of
:mod:`~services.experience.fleet.generator_fleet`, which watches each replica) it turns NOT_SERVING again and new streams get
UNAVAILABLE naming what they wait for, and it turns SERVING as soon as one replica (the same process restarted,
or a replacement) serves again.

Readiness can lag the fleet by up to a probe interval (or a backoff while not ready): whoever learns that what it
watches changed calls :meth:`UpstreamMonitor.probe_soon` (the service does on every change of the fleet's replicas
while not ready: a replica that serves again, a version followed), and a call arriving while not ready may wait a
bounded time for readiness (:meth:`UpstreamMonitor.ready_info`) instead of being refused at once: a replica
following an update made through another experience replica is NOT_SERVING for the moment it loads the new
version, and a trainer's stream opened right after its update must not be refused for that.

The scorer gates readiness only until it was first reached: reward teams swap scorer containers while training
runs, and a Score call that finds the scorer gone is retried by :class:`~services.experience.fleet.clients.ScorerClient`,
so a swap does not take the experience service out of its Service's endpoints.

Nothing here imports grpc: the probes are the clients' methods, raising domain errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from services.common import metrics
from services.common.errors import FastexpError, NotReady

logger = logging.getLogger(__name__)

T = TypeVar("T")

WAITING_LOG_INTERVAL_S = 30.0  # while not ready, what it waits for is logged this often


@dataclass(frozen=True)
class GeneratorInfo:
    """What the generator serves (its ``ModelInfo`` as a domain record).

    ``max_model_len``: most prompt + response tokens per sequence; ``policy_version``: the version of the
    weights it samples with now; ``max_lora_rank``: the highest LoRA rank it takes (0: no adapters);
    ``adapters``: the adapters it holds, name → live version; ``adapter_digests``: name → the digest their load
    named ("": none); ``max_cpu_threads``: the cores a CPU engine's threads may be set to (``SetCpuThreads``; 0:
    not adjustable); ``dtype``: the floating-point type its model runs in ("bfloat16", ...; "" unknown: an older
    generator, or a fleet whose replicas differ).
    """

    model_name: str
    backend: str
    max_model_len: int
    policy_version: int
    multimodal: bool = False
    max_lora_rank: int = 0
    adapters: Mapping[str, int] = field(default_factory=dict)
    adapter_digests: Mapping[str, str] = field(default_factory=dict)
    max_cpu_threads: int = 0
    dtype: str = ""


class GeneratorProbe(Protocol):
    async def model_info(self, timeout_s: float) -> GeneratorInfo:
        """The generator's model info within ``timeout_s``; raises a :class:`FastexpError` otherwise."""
        ...


class ScorerProbe(Protocol):
    async def check_serving(self, timeout_s: float) -> None:
        """Return if the scorer reports SERVING within ``timeout_s``; raise a :class:`FastexpError` otherwise."""
        ...


@dataclass(frozen=True)
class ProbeSettings:
    """How the dependencies are watched (seconds).

    ``timeout_s``: deadline of one probe call; ``interval_s``: time between probes while ready;
    ``backoff_initial_s`` / ``backoff_max_s``: first and largest wait between probes while not ready (doubling,
    plus up to ``backoff_jitter_s`` of random jitter), so a dependency that turns SERVING is seen within
    ``backoff_max_s + backoff_jitter_s + timeout_s``.
    """

    timeout_s: float = 5.0
    interval_s: float = 2.0
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 5.0
    backoff_jitter_s: float = 1.0


def backoff_s(attempt: int, settings: ProbeSettings) -> float:
    """Wait before probe ``attempt + 1`` (0-based): ``min(backoff_max_s, backoff_initial_s * 2**attempt)`` plus a
    uniform jitter in ``[0, backoff_jitter_s)``, so replicas restarted together do not probe in step."""
    base = min(settings.backoff_max_s, settings.backoff_initial_s * 2.0 ** min(attempt, 32))
    return base + random.uniform(0.0, settings.backoff_jitter_s)


class UpstreamMonitor:
    """Probes the generator and scorer until the service stops (:meth:`run`).

    ``on_generator_info(info, first)`` runs each time the generator answers after having been unreachable
    (``first``: the first time since the service started), before readiness turns True.
    """

    def __init__(
        self,
        generator: GeneratorProbe,
        scorer: ScorerProbe,
        *,
        generator_address: str,
        scorer_address: str,
        on_generator_info: Callable[[GeneratorInfo, bool], None] | None = None,
        settings: ProbeSettings | None = None,
    ) -> None:
        self._generator = generator
        self._scorer = scorer
        self._addresses = {"generator": generator_address, "scorer": scorer_address}
        self._on_readiness: Callable[[bool], Awaitable[None]] | None = None
        self.on_generator_info = on_generator_info
        self._settings = settings or ProbeSettings()
        self._info: GeneratorInfo | None = None  # the last answer of the generator
        self._generator_up = False
        self._scorer_reached = False
        self._problems: dict[str, str] = {"generator": "not reached yet", "scorer": "not reached yet"}
        self._since = time.monotonic()  # when readiness last changed
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()  # set by probe_soon: the next probe runs now

    @property
    def ready(self) -> bool:
        """The generator answers now and the scorer has answered once."""
        return self._ready.is_set()

    @property
    def generator_info(self) -> GeneratorInfo | None:
        """The generator's last model info (``None`` before it was first reached)."""
        return self._info

    def require_ready(self) -> GeneratorInfo:
        """The generator's model info, when the service can take a stream now.

        Raises:
            NotReady: naming each dependency waited for, its address, for how long and its last error.
        """
        if self.ready and self._info is not None:
            return self._info
        raise NotReady(self.waiting_for())

    def waiting_for(self) -> str:
        """What readiness waits for, in words ("" when ready)."""
        if self.ready:
            return ""
        waited = time.monotonic() - self._since
        parts = [
            f"the {name} at {self._addresses[name]} ({problem})"
            for name, problem in self._problems.items()
            if problem
        ]
        return f"waiting {waited:.0f} s for " + " and ".join(parts)

    async def ready_info(self, wait_s: float) -> GeneratorInfo:
        """The generator's model info: at once when ready, else once ready within ``wait_s`` seconds (a probe is
        asked for now: readiness may only lag what it watches).

        Raises:
            NotReady: still not ready after ``wait_s``, naming each dependency waited for (as :meth:`require_ready`).
        """
        if not self.ready and wait_s > 0:
            self.probe_soon()
            with contextlib.suppress(TimeoutError):  # refused below, naming what it waits for
                async with asyncio.timeout(wait_s):
                    await self._ready.wait()
        return self.require_ready()

    def probe_soon(self) -> None:
        """Probe now rather than after the interval or backoff under way (what the monitor watches changed)."""
        self._wake.set()

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when :meth:`probe_soon` is called meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        self._wake.clear()

    async def wait_ready(self, timeout_s: float | None = None) -> GeneratorInfo:
        """Return the generator's info once ready.

        Raises:
            TimeoutError: not ready within ``timeout_s``; the message says what it waits for.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        except TimeoutError:
            raise TimeoutError(self.waiting_for()) from None
        return self.require_ready()

    async def run(self, on_readiness: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """Probe for as long as the service runs (cancel the task to stop); ``on_readiness(ready)`` is awaited
        each time readiness changes (the server's health)."""
        self._on_readiness = on_readiness
        settings = self._settings
        while True:
            try:
                await self._until_reachable()
                while await self._probe():
                    await self._pause(settings.interval_s)
                await self._set_ready(False)
                logger.warning("experience service NOT_SERVING: %s", self.waiting_for())
            except Exception:  # noqa: BLE001 - a bug must not freeze readiness: report it, NOT_SERVING, go on
                logger.exception("readiness probe failed; NOT_SERVING until the next probe succeeds")
                await self._set_ready(False)
                await self._pause(settings.backoff_max_s)

    async def _until_reachable(self) -> None:
        """Probe with capped exponential backoff and jitter until both dependencies answer, then turn ready."""
        settings = self._settings
        logged_at = -math.inf
        for attempt in itertools.count():
            if await self._probe():
                break
            if time.monotonic() - logged_at >= WAITING_LOG_INTERVAL_S:  # what a log tail should say
                logger.info("NOT_SERVING: %s", self.waiting_for())
                logged_at = time.monotonic()
            await self._pause(backoff_s(attempt, settings))
        await self._set_ready(True)
        assert self._info is not None
        logger.info("experience service SERVING: generator %s (%s, %s backend, policy version %d), scorer %s",
                    self._addresses["generator"], self._info.model_name, self._info.backend,
                    self._info.policy_version, self._addresses["scorer"])

    async def _probe(self) -> bool:
        """One round of probes; True when the generator answers and the scorer has answered once."""
        timeout = self._settings.timeout_s
        was_up = self._generator_up
        info = await self._call("generator", self._generator.model_info(timeout))
        self._generator_up = info is not None
        if info is not None:
            if not was_up and self.on_generator_info is not None:
                self.on_generator_info(info, self._info is None)
            self._info = info
        if not self._scorer_reached:
            self._scorer_reached = await self._call("scorer", self._scorer.check_serving(timeout)) is not None
        return self._generator_up and self._scorer_reached

    async def _call(self, name: str, probe: Awaitable[T]) -> T | None:
        """Run one probe of dependency ``name``: its answer (``True`` for one without an answer), or ``None``
        when it failed, its error kept for :meth:`waiting_for` and the ``fastexp_dependency_up`` gauge set."""
        try:
            answer = await probe
        except FastexpError as error:
            self._problems[name] = str(error)
            metrics.DEPENDENCY_UP.labels(name).set(0)
            return None
        self._problems[name] = ""
        metrics.DEPENDENCY_UP.labels(name).set(1)
        return True if answer is None else answer

    async def _set_ready(self, ready: bool) -> None:
        if ready == self.ready:
            return
        self._since = time.monotonic()
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        if self._on_readiness is not None:
            await self._on_readiness(ready)

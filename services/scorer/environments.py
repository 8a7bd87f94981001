"""Multi-turn environments: the protocol environment teams implement, and the host that runs their episodes.

An episode is a session: :meth:`EnvironmentHost.start` creates the configured environment by name (operators
name environments in the scorer's ``environments`` setting; a request only picks one of those names), calls its
``reset`` and returns the session id; the experience service then alternates model turns with
:meth:`EnvironmentHost.step` until the environment says ``done`` (with the episode's reward), and ends it with
:meth:`EnvironmentHost.end`. Each step has a deadline (``step_timeout_s``) and each session a lifetime
(``episode_timeout_s``, after which it is dropped); an environment that raises or overruns fails that episode only
(:class:`~services.common.errors.EpisodeFailed`, naming the environment), never the service.

Environments are asynchronous (``async def reset/step``) so that one waiting for a tool does not hold others.
Blocking work goes through the :class:`EnvironmentContext`: ``verify`` (math-verify in the scorer's worker
processes, which have a main thread for its signal-based timeout) and ``run_python`` (the tool sandbox of
:mod:`services.scorer.sandbox`). Built-ins: :mod:`services.scorer.builtin_environments`.

**Fail closed.** An environment class that runs tool code says so with ``requires_sandbox = True``. At start
(:meth:`EnvironmentHost.start_up`) the sandbox's probe runs once; where it fails, those environments are withdrawn
with the cause logged, a request naming one is told why, and ``run_python`` refuses to run anything.
Nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import multiprocessing
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pebble import ProcessPool

from services.common.errors import EpisodeFailed, InvalidRequest, Overloaded
from services.scorer.rules import import_callable, math_verify_reward
from services.scorer.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable

logger = logging.getLogger(__name__)

#: The longest tenant name a request may carry, in bytes (the experience service hashes a longer key).
MAX_TENANT_BYTES = 256


@dataclass(frozen=True)
class EpisodeStart:
    """What an environment is reset with: the prompt as text (rendered), the reference answer, the label, and the
    turn budget (``max_turns`` model turns at most); ``tenant``: who the episode runs for (the experience run's or
    request's id; ``""``: not said), whose share of the tool sandbox its tool calls use."""

    prompt: str
    reference: str
    label: str
    max_turns: int
    tenant: str = ""


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one model turn.

    ``observation``: the next message to the model (``None`` when ``done``), in chat role ``role`` (``user``, or
    ``tool`` for a tool's output); ``reward``: the episode's reward, set when ``done``; ``metrics``: named numbers
    reported with the episode (the last step's win).
    """

    observation: str | None = None
    role: str = "user"
    reward: float | None = None
    done: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (a new instance per episode)."""

    async def reset(self, start: EpisodeStart) -> str | None:
        """Begin the episode; returns a first observation to append after the prompt (``None``: the prompt is
        the first observation)."""
        ...

    async def step(self, action: str) -> StepResult:
        """React to the model's turn ``action`` (its text, as sampled)."""
        ...


@dataclass
class _Shared:
    """What every episode's context shares: the verification worker pool (started on first use), the sandbox and
    why it cannot run (``""``: it can)."""

    workers: int
    verify_timeout_s: float
    sandbox: Sandbox | None
    sandbox_problem: str
    pool: ProcessPool | None = None


class EnvironmentContext:
    """What environments may use: answer verification in worker processes and the tool sandbox (``None``: no
    tool code can run). The worker pool starts with the first verification (a scorer no episode reaches spawns
    nothing); :meth:`close` stops it and the sandbox's connections.

    The host gives each episode's environment the view :meth:`for_tenant` of the episode's tenant
    (``StartEpisodeRequest.tenant``): its ``run_python`` calls then share the sandbox's slots fairly with other
    tenants' (:mod:`services.scorer.sandbox.slots`), with nothing for the environment to pass.
    """

    def __init__(self, workers: int = 2, verify_timeout_s: float = 10.0, sandbox: Sandbox | None = None) -> None:
        problem = "no tool sandbox is configured" if sandbox is None else ""
        self._shared = _Shared(workers, verify_timeout_s, sandbox, problem)
        self.tenant = ""

    def for_tenant(self, tenant: str) -> EnvironmentContext:
        """This context for the episodes of ``tenant`` (the same pool and sandbox)."""
        view = copy.copy(self)  # shallow: the same _Shared
        view.tenant = tenant
        return view

    async def check_sandbox(self) -> str:
        """Probe the sandbox once; returns ``""`` when tool code can run, else the cause and the fix (and every
        later :meth:`run_python` raises :class:`SandboxUnavailable` with it)."""
        shared = self._shared
        if shared.sandbox is not None and not shared.sandbox_problem:
            try:
                await shared.sandbox.check()
            except SandboxUnavailable as error:
                shared.sandbox_problem = str(error)
        return shared.sandbox_problem

    @property
    def sandbox_description(self) -> str:
        """What runs tool code (e.g. ``bubblewrap 0.8.0 (...)``), or why nothing does."""
        if self._shared.sandbox is None or self._shared.sandbox_problem:
            return f"unavailable: {self._shared.sandbox_problem}"
        return self._shared.sandbox.description

    async def verify(self, response: str, reference: str) -> tuple[float, dict[str, float]]:
        """math-verify's ``(reward, {"correct", "answer_found"})`` for ``response`` against ``reference``
        (:func:`services.scorer.rules.math_verify_reward`), in a worker process.

        Raises:
            TimeoutError: the check ran past ``verify_timeout_s`` (its worker is replaced).
        """
        shared = self._shared
        if shared.pool is None:
            shared.pool = ProcessPool(max_workers=shared.workers, context=multiprocessing.get_context("spawn"))
        future = shared.pool.schedule(math_verify_reward, args=(response, reference), timeout=shared.verify_timeout_s)
        return await asyncio.wrap_future(future)

    async def run_python(self, code: str, limits: SandboxLimits) -> SandboxResult:
        """Run ``code`` in the tool sandbox under ``limits``, in a slot of this context's tenant.

        Raises:
            SandboxUnavailable: there is no working sandbox (nothing is run).
            SandboxError: the sandbox could not carry this run out.
        """
        shared = self._shared
        if shared.sandbox is None or shared.sandbox_problem:
            raise SandboxUnavailable(shared.sandbox_problem)
        return await shared.sandbox.run(code, limits, self.tenant)

    async def close(self) -> None:
        shared = self._shared
        if shared.pool is not None:
            shared.pool.stop()
            await asyncio.to_thread(shared.pool.join)
        if shared.sandbox is not None:
            await shared.sandbox.close()


@dataclass(frozen=True)
class EnvironmentSpec:
    """A configured environment: its name, the class (``package.module:Class``) and the keyword options it is
    built with (``cls(context, **options)``), and its deadlines in seconds."""

    name: str
    cls: type
    options: Mapping[str, Any]
    step_timeout_s: float
    episode_timeout_s: float


def load_specs(configs: list[Any]) -> dict[str, EnvironmentSpec]:
    """Resolve the configured environments' classes (``EnvironmentConfig`` records) by name.

    Raises:
        ImportError, TypeError: a class path that does not resolve to a class (named).
    """
    specs = {}
    for config in configs:
        cls = import_callable(config.cls)
        if not isinstance(cls, type):
            raise TypeError(f"environment {config.name}: {config.cls!r} is not a class")
        specs[config.name] = EnvironmentSpec(config.name, cls, dict(config.options), config.step_timeout_s,
                                             config.episode_timeout_s)
    return specs


@dataclass
class _Session:
    spec: EnvironmentSpec
    environment: Environment
    expires_at: float
    turns: int = 0
    stepping: asyncio.Task | None = None  # the step in progress, if any


class EnvironmentHost:
    """Runs episodes of the configured environments as sessions (module docs)."""

    def __init__(self, specs: Mapping[str, EnvironmentSpec], context: EnvironmentContext, max_sessions: int = 4096):
        self.specs = dict(specs)
        self._context = context
        self._max_sessions = max_sessions
        self._sessions: dict[str, _Session] = {}
        self._ids = itertools.count()
        self.withdrawn: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self.specs)

    async def start_up(self) -> None:
        """Probe the tool sandbox if a configured environment needs one; where it does not work, withdraw those
        environments (:attr:`withdrawn`: name -> why) and log the cause and the fix as an error."""
        needing = [name for name, spec in self.specs.items() if getattr(spec.cls, "requires_sandbox", False)]
        if not needing:
            return
        problem = await self._context.check_sandbox()
        if not problem:
            logger.info("tool sandbox ready: %s (for %s)", self._context.sandbox_description, ", ".join(needing))
            return
        for name in needing:
            self.withdrawn[name] = problem
            del self.specs[name]
        logger.error("tool environments %s are NOT offered: the tool sandbox does not work here: %s",
                     ", ".join(needing), problem)

    async def start(self, name: str, start: EpisodeStart) -> tuple[str, str | None]:
        """Create environment ``name`` for a new episode and reset it; returns (session id, first observation).

        Raises:
            InvalidRequest: ``environment``: no environment of that name is configured (the configured ones are
                listed); ``max_turns`` < 1; ``tenant`` over :data:`MAX_TENANT_BYTES`.
            Overloaded: ``max_sessions`` episodes are open.
            EpisodeFailed: the environment failed to start or reset.
        """
        spec = self.specs.get(name)
        if name in self.withdrawn:
            raise InvalidRequest("environment", f"{name!r} is not offered here: {self.withdrawn[name]}")
        if spec is None:
            raise InvalidRequest("environment", f"no environment {name!r} here (configured: {', '.join(self.names)})")
        if start.max_turns < 1:
            raise InvalidRequest("max_turns", "must be >= 1")
        if len(start.tenant.encode()) > MAX_TENANT_BYTES:
            raise InvalidRequest("tenant", f"over {MAX_TENANT_BYTES} bytes")
        self._expire()
        if len(self._sessions) >= self._max_sessions:
            raise Overloaded(f"max_sessions: {len(self._sessions)} episodes are open; retry later")
        try:
            environment = spec.cls(self._context.for_tenant(start.tenant), **spec.options)
            async with asyncio.timeout(spec.step_timeout_s):
                first = await environment.reset(start)
        except Exception as error:  # noqa: BLE001 - an environment's failure is that episode's, named
            raise EpisodeFailed(_failure(spec.name, "reset", error)) from error
        session_id = f"{name}-{next(self._ids)}-{secrets.token_hex(6)}"
        self._sessions[session_id] = _Session(spec, environment, time.monotonic() + spec.episode_timeout_s)
        return session_id, first

    async def step(self, session_id: str, action: str) -> StepResult:
        """Send the model's turn to the session's environment; a ``done`` result ends the session.

        Raises:
            EpisodeFailed: unknown or expired session, a step already running for it, the episode ended while the
                step ran, or the environment raised or overran ``step_timeout_s`` (the session is dropped).
        """
        session = self._session(session_id)
        if session.stepping is not None:
            raise EpisodeFailed(f"session {session_id}: a step is already running")
        try:
            session.stepping = asyncio.ensure_future(session.environment.step(action))
            async with asyncio.timeout(session.spec.step_timeout_s):
                result = await session.stepping  # cancelling this call (or the timeout) cancels the step too
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this call was cancelled, not the step by end()
                raise
            raise EpisodeFailed(f"session {session_id}: the episode ended while its step ran") from None
        except Exception as error:  # noqa: BLE001 - that episode fails, named; the service goes on
            self._sessions.pop(session_id, None)
            raise EpisodeFailed(_failure(session.spec.name, f"step {session.turns + 1}", error)) from error
        finally:
            session.stepping = None
        session.turns += 1
        if result.done:
            self._sessions.pop(session_id, None)
        return result

    async def end(self, session_id: str) -> None:
        """Forget a session (idempotent); a step still running for it is cancelled, and this returns once it ended
        (its tool run, if any, killed and reaped)."""
        session = self._sessions.pop(session_id, None)
        stepping = session.stepping if session is not None else None
        if stepping is not None and not stepping.done():
            stepping.cancel()
            await asyncio.wait({stepping})

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def _session(self, session_id: str) -> _Session:
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise EpisodeFailed(f"session {session_id}: unknown or expired (the environment service may have restarted)")
        return session

    def _expire(self) -> None:
        now = time.monotonic()
        for session_id in [s for s, session in self._sessions.items() if session.expires_at < now]:
            logger.warning("episode %s expired after %.0f s", session_id, self._sessions[session_id].spec.episode_timeout_s)
            del self._sessions[session_id]


def _failure(name: str, what: str, error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return f"environment {name}: {what} ran past its deadline"
    return f"environment {name}: {what} failed: {type(error).__name__}: {error}"

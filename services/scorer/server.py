"""Scorer service entry: build the reward sources and environments from settings, serve ``fastexp.v1.ScoringService``
and ``fastexp.v1.EnvironmentService``.

Health: the overall status and each service's follow the sources' start; each networked source (remote, judge) also
has its own health service name, ``fastexp.v1.ScoringService/<source>``, SERVING while its circuit breaker is
closed and NOT_SERVING while it is open or half-open (the scorer keeps serving the other sources).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from fastexp.v1 import environment_pb2, environment_pb2_grpc, scoring_pb2, scoring_pb2_grpc
from services.common.server import RunningServer, run_service, serving, start_service
from services.scorer.composition import ConfigError, RewardComposer, build_composer
from services.scorer.environment_servicer import EnvironmentServicer
from services.scorer.environments import EnvironmentContext, EnvironmentHost, load_specs
from services.scorer.outbound.breaker import BreakerStatus
from services.scorer.sandbox import build_sandbox
from services.scorer.servicer import ScoringServicer
from services.scorer.settings import ScorerSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["ScoringService"].full_name
ENVIRONMENT_SERVICE_NAME = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name


@dataclass
class ScorerCore:
    """What the scorer process runs: the reward sources' composition and the multi-turn environments' host."""

    composer: RewardComposer
    environments: EnvironmentHost
    context: EnvironmentContext

    async def close(self) -> None:
        await self.composer.close()
        await self.context.close()


def build_environments(settings: ScorerSettings) -> tuple[EnvironmentHost, EnvironmentContext]:
    """The configured environments' host (their classes resolved now; the worker pool starts on first use; the
    tool sandbox is probed by :meth:`EnvironmentHost.start_up`).

    Raises:
        ConfigError: an environment class path that does not resolve (named).
        SecurityConfigError: the remote sandbox's token file is unreadable.
    """
    try:
        specs = load_specs(settings.environments)
    except (ImportError, TypeError) as error:
        raise ConfigError(f"environments: {error}") from error
    context = EnvironmentContext(settings.environment_workers, sandbox=build_sandbox(settings.sandbox))
    return EnvironmentHost(specs, context, settings.max_episodes), context


def build_scorer(settings: ScorerSettings) -> ScorerCore:
    """The configured sources and their composition (not started), and the environments.

    Raises:
        ConfigError: an import path in the settings does not resolve (every one is named).
    """
    return ScorerCore(build_composer(settings), *build_environments(settings))


async def start_scorer(settings: ScorerSettings, scorer: ScorerCore | RewardComposer) -> RunningServer:
    """Start ``scorer``'s sources, then serve scoring and environments; health is SERVING once every source has
    started. A bare composer gets the settings' environments.

    Raises:
        ConfigError: a source could not start (missing model folder, bad import path); nothing is left serving.
    """
    core = scorer if isinstance(scorer, ScorerCore) else ScorerCore(scorer, *build_environments(settings))
    servicer = ScoringServicer(core.composer, settings)
    environments = EnvironmentServicer(core.environments)

    def register(server: grpc.aio.Server) -> None:
        scoring_pb2_grpc.add_ScoringServiceServicer_to_server(servicer, server)
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(environments, server)

    running = await start_service(settings, (SERVICE_NAME, ENVIRONMENT_SERVICE_NAME), register)
    try:
        await core.composer.start()
        await core.environments.start_up()
    except BaseException:
        await running.server.stop(0)
        raise
    await running.set_serving(True)
    await _report_breakers(running, core.composer)
    logger.info("scorer serving on %s:%d (sources: %s; environments: %s)", settings.host, running.port,
                ", ".join(core.composer.source_names), ", ".join(core.environments.names))
    return running


def breaker_health_name(source: str) -> str:
    """The health service name that reports ``source``'s circuit breaker (module docs)."""
    return f"{SERVICE_NAME}/{source}"


async def _report_breakers(running: RunningServer, composer: RewardComposer) -> None:
    """Publish each breaker's state as its source's health status now and on every change."""
    pending: set[asyncio.Task] = set()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    for name, breaker in composer.breakers().items():
        service = breaker_health_name(name)
        await running.health.set(service, serving if breaker.state.status is BreakerStatus.CLOSED else not_serving)

        def changed(status: BreakerStatus, service: str = service) -> None:
            task = asyncio.get_running_loop().create_task(
                running.health.set(service, serving if status is BreakerStatus.CLOSED else not_serving)
            )
            pending.add(task)
            task.add_done_callback(pending.discard)

        breaker.listen(changed)


def serve(settings: ScorerSettings) -> None:
    """Run the scorer until SIGTERM/SIGINT (blocking)."""
    start = serving(lambda: build_scorer(settings), lambda resource: start_scorer(settings, resource))
    run_service(start, settings.grace_period_s)

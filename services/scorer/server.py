"""Scorer service entry: build the reward sources and environments from settings, serve ``fastexp.v1.ScoringService``
and ``fastexp.v1.EnvironmentService``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from fastexp.v1 import environment_pb2, environment_pb2_grpc, scoring_pb2, scoring_pb2_grpc
from services.common.server import RunningServer, run_service, serving, start_service
from services.scorer.composition import ConfigError, RewardComposer, build_composer
from services.scorer.environment_servicer import EnvironmentServicer
from services.scorer.environments import EnvironmentContext, EnvironmentHost, load_specs
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
    logger.info("scorer serving on %s:%d (sources: %s; environments: %s)", settings.host, running.port,
                ", ".join(core.composer.source_names), ", ".join(core.environments.names))
    return running


def serve(settings: ScorerSettings) -> None:
    """Run the scorer until SIGTERM/SIGINT (blocking)."""
    start = serving(lambda: build_scorer(settings), lambda resource: start_scorer(settings, resource))
    run_service(start, settings.grace_period_s)

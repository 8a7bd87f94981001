"""Scorer service entry: build the reward sources from settings, serve ``fastexp.v1.ScoringService``."""

from __future__ import annotations

import logging

from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.server import RunningServer, run_service, serving, start_service
from services.scorer.composition import RewardComposer, build_composer
from services.scorer.servicer import ScoringServicer
from services.scorer.settings import ScorerSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["ScoringService"].full_name


def build_scorer(settings: ScorerSettings) -> RewardComposer:
    """The configured sources and their composition (not started).

    Raises:
        ConfigError: an import path in the settings does not resolve (every one is named).
    """
    return build_composer(settings)


async def start_scorer(settings: ScorerSettings, scorer: RewardComposer) -> RunningServer:
    """Start ``scorer``'s sources, then serve it; health is SERVING once every source has started.

    Raises:
        ConfigError: a source could not start (missing model folder, bad import path); nothing is left serving.
    """
    servicer = ScoringServicer(scorer, settings)
    running = await start_service(
        settings, SERVICE_NAME, lambda server: scoring_pb2_grpc.add_ScoringServiceServicer_to_server(servicer, server)
    )
    try:
        await scorer.start()
    except BaseException:
        await running.server.stop(0)
        raise
    await running.set_serving(True)
    logger.info("scorer serving on %s:%d (sources: %s)", settings.host, running.port, ", ".join(scorer.source_names))
    return running


def serve(settings: ScorerSettings) -> None:
    """Run the scorer until SIGTERM/SIGINT (blocking)."""
    start = serving(lambda: build_scorer(settings), lambda resource: start_scorer(settings, resource))
    run_service(start, settings.grace_period_s)

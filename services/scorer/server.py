"""Scorer service entry: build the reward function from settings, serve ``fastexp.v1.ScoringService``."""

from __future__ import annotations

import asyncio
import logging

from fastexp.v1 import scoring_pb2, scoring_pb2_grpc
from services.common.server import RunningServer, create_server, serve_until_signalled
from services.common.settings import ScorerSettings
from services.scorer.rules import RULES
from services.scorer.scorer import RuleScorer
from services.scorer.servicer import ScoringServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = scoring_pb2.DESCRIPTOR.services_by_name["ScoringService"].full_name


def build_scorer(settings: ScorerSettings) -> RuleScorer:
    """The configured rule function in its worker pool."""
    return RuleScorer(RULES[settings.reward_fn], workers=settings.verifier_workers,
                      timeout_s=settings.verifier_timeout_s)


async def start_scorer(settings: ScorerSettings, scorer: RuleScorer) -> RunningServer:
    """Serve ``scorer``; health is SERVING once its workers have run the rule once."""
    servicer = ScoringServicer(scorer, settings)
    running = await create_server(
        host=settings.host,
        port=settings.port,
        register=lambda server: scoring_pb2_grpc.add_ScoringServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        max_message_bytes=settings.max_message_bytes,
    )
    await scorer.warm_up()
    await running.set_serving(True)
    logger.info("scorer serving on %s:%d (%s)", settings.host, running.port, settings.reward_fn)
    return running


def serve(settings: ScorerSettings) -> None:
    """Run the scorer until SIGTERM/SIGINT (blocking)."""

    async def main() -> None:
        scorer = build_scorer(settings)
        running = await start_scorer(settings, scorer)
        await serve_until_signalled(running, settings.grace_period_s, cleanup=scorer.close)

    asyncio.run(main())

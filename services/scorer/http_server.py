"""The reference remote reward server: any scorer configuration served over OpenRLHF's HTTP reward protocol.

Reward teams deploy their model (or rule, or composition) behind this and point trainers, or a fastexp scorer's
``remote`` source, at it. FastAPI + uvicorn, on the HTTP edges' configuration (:mod:`services.common.http_edge`:
TLS when ``tls_cert_file`` is set, headers bounded, at most ``MAX_CONNECTIONS`` at once); the tokens of
``auth_tokens_file`` and ``admin_tokens_file`` may call.

``POST /get_reward`` with ``{"query": [...], "prompts": [...]?, "labels": [...]?, "references": [...]?}``
answers ``{"rewards": [...], "scores": [...], "extra_logs": {metric: [...]}, "errors": [...]?}``. A query the
sources could not score has ``null`` as its reward and score and its reason in ``errors`` (present only then),
so one bad item never costs the batch. Bad input (lengths differ, a query not starting with its prompt, a label
without recipe) is HTTP 400 naming the field; more than ``max_queries_per_request`` queries is HTTP 413.
``GET /health`` is 200 once every source has started; its ``breakers`` say each networked source's circuit breaker
(closed, half_open, open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Sequence

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from services.common.errors import InvalidRequest
from services.common.http_edge import run_edge, service_edge_config
from services.common.http_limits import BoundedBody, bearer_check
from services.common.http_tokens import edge_tokens
from services.common.security import check_exposure
from services.scorer.composition import RewardComposer, build_composer
from services.scorer.scorer import make_items
from services.scorer.settings import RewardServerSettings

logger = logging.getLogger(__name__)


class RewardRequest(BaseModel):
    """OpenRLHF's reward request, plus ``references``."""

    query: list[str] = Field(description="prompt + response texts, special tokens kept")
    prompts: list[str] | None = Field(None, description="prompt texts, each a prefix of its query")
    labels: list[str] | None = Field(None, description="labels: pick each query's reward recipe")
    references: list[str] | None = Field(None, description="reference answers")


class RewardResponse(BaseModel):
    """OpenRLHF's reward response, plus ``errors`` for the queries that have no reward."""

    rewards: list[float | None]
    scores: list[float | None]
    extra_logs: dict[str, list[float | None]]
    errors: list[str | None] | None = None


def _json_floats(values) -> list[float | None]:
    return [None if math.isnan(v) else float(v) for v in values.tolist()]


def create_app(composer: RewardComposer, max_queries_per_request: int = 65536, manage_sources: bool = True,
               tokens: Sequence[bytes] = (), max_body_bytes: int = 64 * 1024 * 1024) -> FastAPI:
    """The FastAPI app serving ``composer``; with ``manage_sources`` its lifespan starts and closes the sources.
    ``tokens``: the bearer tokens a call must present (empty: none), checked before its body is read; bodies over
    ``max_body_bytes`` are 413, unread (:class:`~services.common.http_limits.BoundedBody`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not manage_sources:
            yield
            return
        await composer.start()
        try:
            yield
        finally:
            await composer.close()

    app = FastAPI(title="fastexp reward server", lifespan=lifespan)
    app.add_middleware(BoundedBody, max_bytes=max_body_bytes, authorized=bearer_check(tokens))

    @app.get("/health")
    async def health() -> dict[str, object]:
        breakers = {name: breaker.state.status.name.lower() for name, breaker in composer.breakers().items()}
        return {"status": "ok", "sources": composer.source_names, "breakers": breakers}

    @app.post("/get_reward", response_model_exclude_none=True)
    async def get_reward(request: RewardRequest) -> RewardResponse:
        if len(request.query) > max_queries_per_request:
            raise HTTPException(413, f"query: at most {max_queries_per_request} per request")
        try:
            items = make_items(request.query, request.prompts or [], request.labels or [], request.references or [])
            result = await composer.score(items)
        except InvalidRequest as error:
            raise HTTPException(400, str(error)) from error
        rewards = _json_floats(result.rewards)
        return RewardResponse(
            rewards=rewards,
            scores=rewards,
            extra_logs={name: _json_floats(values) for name, values in result.metrics.items()},
            errors=list(result.errors) if any(result.errors) else None,
        )

    return app


def server_config(composer: RewardComposer, settings: RewardServerSettings) -> uvicorn.Config:
    """How :func:`serve` serves ``composer`` (started): :func:`create_app` with the tokens of both token files, on
    the HTTP edges' uvicorn configuration (TLS when ``tls_cert_file`` is set).

    Raises:
        SecurityConfigError: a token file that is set is unreadable or holds no token.
    """
    app = create_app(composer, settings.max_queries_per_request, manage_sources=False, tokens=edge_tokens(settings),
                     max_body_bytes=settings.max_body_bytes)
    return service_edge_config(app, settings)


def serve(settings: RewardServerSettings) -> None:
    """Start the sources, then serve until SIGTERM/SIGINT (blocking; uvicorn drains, then the sources close and
    the process exits 0, as the gRPC services do).

    Raises:
        ConfigError: a source could not be built or started (before the port is opened).
        SecurityConfigError: bound beyond loopback without TLS or tokens and not ``insecure`` (the gRPC services'
            rule); a token file is unreadable.
    """
    check_exposure(settings.host, secured=settings.secured(), insecure=settings.insecure, service="reward-server")
    edge_tokens(settings)  # an unreadable token file fails before the sources start
    composer = build_composer(settings)

    async def main() -> None:
        await composer.start()
        try:
            await run_edge(server_config(composer, settings))
        finally:
            await composer.close()

    asyncio.run(main())

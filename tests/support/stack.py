"""The three services in process on port 0 (HF backend, the scorer's rule or judge sources, the experience service
over both), for integration test modules that share one stack: :func:`three_services`.

Each service's settings are the defaults below plus the keyword dict a module passes for it; the services are
stopped and their engines closed in reverse order on exit (channels, experience, scorer, generator, engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from fastexp.v1 import experience_pb2_grpc, generation_pb2_grpc, scoring_pb2_grpc
from services.common.server import RunningServer
from services.experience.server import ExperienceService, start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import ScorerCore, build_scorer, start_scorer
from services.scorer.settings import ScorerSettings

#: The scorer's default source: math-verify in one worker process (no fallback reward).
MATH_VERIFY = {"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward",
               "workers": 1}
#: The same, scoring a response math-verify fails on as 0.0.
MATH_VERIFY_OR_ZERO = {**MATH_VERIFY, "fallback_reward": 0.0}
MAX_MODEL_LEN = 256

#: (service name, its address) -> an async context manager yielding the address the experience service dials
#: instead (a proxy in front of it, tests/support/gates.py); entered after both upstreams start.
Route = Callable[[str, str], contextlib.AbstractAsyncContextManager[str]]


@dataclass(frozen=True)
class Stack:
    """The running services, their addresses (``host:port``) and stubs over insecure channels to each.

    ``generator_address``/``scorer_address`` are the services' own; the experience service dials them, or what
    ``route`` gave in front of them (``upstream_addresses``).
    """

    engine: HFEngine
    generator: RunningServer
    scorer_core: ScorerCore
    scorer: RunningServer
    experience: ExperienceService
    generator_address: str
    scorer_address: str
    experience_address: str
    upstream_addresses: Mapping[str, str]
    experience_stub: experience_pb2_grpc.ExperienceServiceStub
    health: health_pb2_grpc.HealthStub  # the experience service's
    generator_stub: generation_pb2_grpc.GenerationServiceStub
    scorer_stub: scoring_pb2_grpc.ScoringServiceStub


@contextlib.asynccontextmanager
async def three_services(
    model_path: str, *, engine: Mapping[str, Any] | None = None, generator: Mapping[str, Any] | None = None,
    scorer: Mapping[str, Any] | None = None, experience: Mapping[str, Any] | None = None, host: str = "127.0.0.1",
    route: Route | None = None, ready_timeout_s: float = 60,
) -> AsyncIterator[Stack]:
    """Start the generator (an :class:`HFEngine` on ``model_path``), the scorer and the experience service.

    Defaults, each replaced key by key by the matching keyword dict:
    ``engine``: ``HFEngine.start`` arguments, float32, ``max_model_len`` 256, ``max_batch_size`` 4;
    ``generator``: ``GeneratorSettings``, port 0, ``max_model_len`` 256;
    ``scorer``: ``ScorerSettings``, port 0, sources ``[MATH_VERIFY]``;
    ``experience``: ``ExperienceSettings``, port 0, the upstreams' addresses, actor and reference ``model_path``,
    float32. ``host`` names the services in the addresses (``localhost`` for TLS certificates made for it).
    Returns once the experience service reached both upstreams (``wait_ready(ready_timeout_s)``).

    Raises:
        TimeoutError: the experience service was not ready within ``ready_timeout_s``.
    """
    async with contextlib.AsyncExitStack() as exits:
        hf = HFEngine.start(model_path, **{"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_batch_size": 4,
                                          **(engine or {})})
        exits.push_async_callback(hf.close)
        running_generator = await start_generator(
            GeneratorSettings(**{"port": 0, "max_model_len": MAX_MODEL_LEN, **(generator or {})}), hf)
        exits.push_async_callback(running_generator.stop, 1)
        scorer_settings = ScorerSettings(**{"port": 0, "sources": [MATH_VERIFY], **(scorer or {})})
        core = build_scorer(scorer_settings)
        exits.push_async_callback(core.close)
        running_scorer = await start_scorer(scorer_settings, core)
        exits.push_async_callback(running_scorer.stop, 1)
        own = {"generator": f"{host}:{running_generator.port}", "scorer": f"{host}:{running_scorer.port}"}
        upstreams = dict(own) if route is None else {
            name: await exits.enter_async_context(route(name, address)) for name, address in own.items()}
        service = await start_experience(ExperienceSettings(**{
            "port": 0, "generator_address": upstreams["generator"], "scorer_address": upstreams["scorer"],
            "actor_model": model_path, "reference_model": model_path, "dtype": "float32", **(experience or {})}))
        exits.push_async_callback(service.close)
        exits.push_async_callback(service.running.stop, 1)
        await service.wait_ready(ready_timeout_s)
        experience_address = f"{host}:{service.running.port}"
        channels = {name: grpc.aio.insecure_channel(address)
                    for name, address in (*own.items(), ("experience", experience_address))}
        for channel in channels.values():
            exits.push_async_callback(channel.close)
        yield Stack(
            engine=hf, generator=running_generator, scorer_core=core, scorer=running_scorer, experience=service,
            generator_address=own["generator"], scorer_address=own["scorer"], experience_address=experience_address,
            upstream_addresses=upstreams,
            experience_stub=experience_pb2_grpc.ExperienceServiceStub(channels["experience"]),
            health=health_pb2_grpc.HealthStub(channels["experience"]),
            generator_stub=generation_pb2_grpc.GenerationServiceStub(channels["generator"]),
            scorer_stub=scoring_pb2_grpc.ScoringServiceStub(channels["scorer"]),
        )

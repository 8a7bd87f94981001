"""Generator service entry: build the engine from settings, serve ``fastexp.v1.GenerationService``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common import metrics
from services.common.models import resolve_model
from services.common.server import RunningServer, run_service, start_service
from services.generator.engine import GenerationEngine
from services.generator.servicer import GenerationServicer
from services.generator.settings import GeneratorSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


def build_engine(settings: GeneratorSettings) -> GenerationEngine:
    """Start the configured backend (``auto``: vLLM when importable, else HF) on the resolved model."""
    from services.generator.vllm_engine import VLLMEngine, vllm_available

    model = resolve_model(settings.model)
    backend = settings.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    logger.info("starting the %s engine on %s", backend, model)
    if backend == "vllm":
        return VLLMEngine.start(
            model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            seed=settings.seed,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            max_num_seqs=settings.max_num_seqs,
            max_images_per_prompt=settings.max_images_per_prompt,
            max_videos_per_prompt=settings.max_videos_per_prompt,
        )
    from services.generator.hf_engine import HFEngine

    return HFEngine.start(
        model, dtype=settings.dtype, max_model_len=settings.max_model_len, max_batch_size=settings.hf_max_batch_size
    )


async def start_generator(settings: GeneratorSettings, engine: GenerationEngine) -> RunningServer:
    """Serve ``engine`` on ``settings.host:settings.port``; health is SERVING once the engine is healthy."""
    servicer = GenerationServicer(engine, settings)
    running = await start_service(
        settings, SERVICE_NAME, lambda server: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    )
    await engine.check_health()
    metrics.POLICY_VERSION.labels("generator").set_function(lambda: engine.policy_version)
    await running.set_serving(True)
    logger.info("generator serving on %s:%d (%s backend)", settings.host, running.port, engine.description.backend)
    return running


def serve(settings: GeneratorSettings) -> None:
    """Run the generator until SIGTERM/SIGINT (blocking)."""

    async def start() -> tuple[RunningServer, Callable[[], Awaitable[None]]]:
        engine = build_engine(settings)
        return await start_generator(settings, engine), engine.close

    run_service(start, settings.grace_period_s)

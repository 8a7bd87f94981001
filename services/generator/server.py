"""Generator service entry: build the engine from settings, serve ``fastexp.v1.GenerationService``."""

from __future__ import annotations

import inspect
import logging
import os

from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common import metrics
from services.common.dtypes import resolve_dtype
from services.common.models import resolve_model
from services.common.server import RunningServer, run_service, serving, start_service
from services.generator.engine import GenerationEngine
from services.generator.servicer import GenerationServicer
from services.generator.settings import GeneratorSettings

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class ParallelismError(ValueError):
    """The generator's parallelism settings do not fit the backend or the machine (a start-up error)."""


def check_parallelism(tensor_parallel_size: int, data_parallel_size: int, backend: str, gpus: int) -> None:
    """Reject, before any model is loaded, parallelism the backend or machine cannot run.

    Raises:
        ParallelismError: more than one GPU asked of the HF backend, or more GPUs than ``gpus`` visible ones;
            the message names the settings and what the machine has.
    """
    needed = tensor_parallel_size * data_parallel_size
    if needed == 1:
        return
    asked = f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} = {needed} GPUs"
    if backend != "vllm":
        raise ParallelismError(f"{asked}, but the {backend} backend runs one device; use backend vllm")
    if needed > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ParallelismError(f"{asked}, but this machine has {gpus} visible{where}")


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_engine(settings: GeneratorSettings) -> GenerationEngine:
    """Start the configured backend (``auto``: vLLM when importable, else HF) on the resolved model.

    Raises:
        ParallelismError: see :func:`check_parallelism` (checked before anything is loaded).
    """
    from services.generator.vllm_engine import VLLMEngine, engine_options, vllm_available

    backend = settings.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    check_parallelism(settings.tensor_parallel_size, settings.data_parallel_size, backend, _visible_gpus())
    model = resolve_model(settings.model)
    dtype = resolve_dtype(settings.dtype, "cuda" if _visible_gpus() else "cpu")
    logger.info("starting the %s engine on %s in %s (dtype setting %s)", backend, model, dtype, settings.dtype)
    if backend == "vllm":
        # every keyword of engine_options but the model is a generator setting of the same name
        names = [name for name in inspect.signature(engine_options).parameters if name != "model"]
        return VLLMEngine.start(model, busy_loop_s=settings.vllm_busy_loop_s, engine_process=settings.vllm_engine_process,
                                **{**settings.model_dump(include=set(names)), "dtype": dtype})
    from services.generator.hf_engine import HFEngine

    return HFEngine.start(
        model, dtype=dtype, max_model_len=settings.max_model_len, max_batch_size=settings.hf_max_batch_size,
        max_lora_rank=settings.max_lora_rank if settings.max_loras else 0,
    )


async def start_generator(settings: GeneratorSettings, engine: GenerationEngine) -> RunningServer:
    """Serve ``engine`` on ``settings.host:settings.port``; health is SERVING once the engine is healthy."""
    servicer = GenerationServicer(engine, settings)
    running = await start_service(
        settings, SERVICE_NAME, lambda server: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    )
    await engine.check_health()
    if engine.cpu_threads is not None:
        await engine.cpu_threads.start()
    metrics.POLICY_VERSION.labels("generator").set_function(lambda: engine.policy_version)
    await running.set_serving(True)
    logger.info("generator serving on %s:%d (%s backend)", settings.host, running.port, engine.description.backend)
    return running


def serve(settings: GeneratorSettings) -> None:
    """Run the generator until SIGTERM/SIGINT (blocking)."""
    start = serving(lambda: build_engine(settings), lambda resource: start_generator(settings, resource))
    run_service(start, settings.grace_period_s)

"""Experience service entry: connect to the generator and scorer, load actor/reference, serve."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from fastexp.v1 import experience_pb2, experience_pb2_grpc
from services.common.models import resolve_model
from services.common.server import RunningServer, create_server, serve_until_signalled
from services.common.settings import ExperienceSettings
from services.experience.clients import GeneratorClient, ScorerClient, open_channel
from services.experience.logprobs import LogProbModel
from services.experience.pipeline import ExperienceMaker, ForwardModels
from services.experience.policy import PolicyState
from services.experience.runs import RunStore
from services.experience.servicer import ExperienceServicer
from services.experience.value_model import ValueModel
from services.experience.vision import VisionProcessor

logger = logging.getLogger(__name__)

SERVICE_NAME = experience_pb2.DESCRIPTOR.services_by_name["ExperienceService"].full_name


@dataclass
class ExperienceService:
    """A running experience server and what it must close."""

    running: RunningServer
    channels: tuple[grpc.aio.Channel, ...]

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


async def start_experience(settings: ExperienceSettings) -> ExperienceService:
    """Load the actor, reference (and critic), wait for the generator, and serve; SERVING once all is done.

    Raises:
        NotReady: the generator did not answer within ``connect_timeout_s``.
    """
    import torch
    from transformers import AutoTokenizer

    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    tls, token = settings.upstream_tls(), settings.upstream_token()
    generator_channel = open_channel(settings.generator_address, settings.max_message_bytes, tls, token)
    scorer_channel = open_channel(settings.scorer_address, settings.max_message_bytes, tls, token)
    generator = GeneratorClient(generator_channel, settings.generate_timeout_s, settings.update_weights_timeout_s)
    scorer = ScorerClient(scorer_channel, settings.score_timeout_s)
    actor_path = resolve_model(settings.actor_model)
    reference_path = resolve_model(settings.reference_model)
    actor = LogProbModel.load(actor_path, dtype=settings.dtype, device=settings.device)
    reference = LogProbModel.load(reference_path, dtype=settings.dtype, device=settings.device)
    critic = None
    if settings.critic_model:
        critic = ValueModel.load(resolve_model(settings.critic_model), dtype=settings.dtype, device=settings.device)
    models = ForwardModels(actor, reference, critic, settings.forward_micro_batch_size, settings.forward_share_prompt)
    vision = VisionProcessor.load(actor_path)  # None for a text-only policy
    tokenizer = vision.tokenizer if vision is not None else AutoTokenizer.from_pretrained(actor_path)
    info = await generator.model_info(settings.connect_timeout_s)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if info.policy_version:
        logger.warning(
            "the generator serves policy version %d, but the actor replica was loaded from %s: action_log_probs "
            "follow the loaded weights until the next policy update through this service",
            info.policy_version, actor_path,
        )
    maker = ExperienceMaker(
        generator, scorer, models, pad_token_id=pad, runs=RunStore(settings.max_runs),
        policy=PolicyState(info.policy_version), max_groups_ahead=settings.max_groups_ahead,
    )
    servicer = ExperienceServicer(
        maker, tokenizer, settings.request_limits(), info.max_model_len, settings.weights_staging_dir,
        settings.max_concurrent_streams, vision=vision, media_limits=settings.media_limits(),
    )
    if vision is not None and not info.multimodal:
        logger.warning("the policy %s is vision-language but the generator does not accept images", actor_path)
    running = await create_server(
        host=settings.host,
        port=settings.port,
        register=lambda server: experience_pb2_grpc.add_ExperienceServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        max_message_bytes=settings.max_message_bytes,
        tls=settings.server_tls(),
        auth=settings.auth(),
    )
    await running.set_serving(True)
    logger.info(
        "experience serving on %s:%d (generator %s: %s, %s backend)",
        settings.host, running.port, settings.generator_address, info.model_name, info.backend,
    )
    return ExperienceService(running, (generator_channel, scorer_channel))


def serve(settings: ExperienceSettings) -> None:
    """Run the experience service until SIGTERM/SIGINT (blocking)."""

    async def main() -> None:
        service = await start_experience(settings)
        await serve_until_signalled(service.running, settings.grace_period_s, cleanup=service.close)

    asyncio.run(main())

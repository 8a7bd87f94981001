"""Experience service entry: load actor/reference, serve, and watch the generator and scorer it depends on."""

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
from services.experience.upstream import GeneratorInfo, ProbeSettings, UpstreamMonitor
from services.experience.value_model import ValueModel
from services.experience.vision import VisionProcessor

logger = logging.getLogger(__name__)

SERVICE_NAME = experience_pb2.DESCRIPTOR.services_by_name["ExperienceService"].full_name


@dataclass
class ExperienceService:
    """A running experience server, the task watching its dependencies, and what it must close."""

    running: RunningServer
    upstream: UpstreamMonitor
    watcher: asyncio.Task[None]
    channels: tuple[grpc.aio.Channel, ...]

    async def wait_ready(self, timeout_s: float | None = None) -> GeneratorInfo:
        """Return once the generator and scorer were reached (health SERVING).

        Raises:
            TimeoutError: not within ``timeout_s``; the message says what it waits for.
        """
        return await self.upstream.wait_ready(timeout_s)

    async def close(self) -> None:
        self.watcher.cancel()
        await asyncio.gather(self.watcher, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


async def start_experience(settings: ExperienceSettings) -> ExperienceService:
    """Load the actor, reference (and critic), serve, and watch the generator and scorer.

    Returns once the server is bound: health is NOT_SERVING (and ``MakeExperiences`` answers UNAVAILABLE naming
    what it waits for) until the generator and the scorer have answered, however long that takes; see
    :mod:`services.experience.upstream`. ``await service.wait_ready()`` waits for that.
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
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = PolicyState()
    maker = ExperienceMaker(
        generator, scorer, models, pad_token_id=pad, runs=RunStore(settings.max_runs),
        policy=policy, max_groups_ahead=settings.max_groups_ahead,
    )

    def generator_reached(info: GeneratorInfo, first: bool) -> None:
        if first:
            # no stream or update can have run yet (both need the generator): its version is the live one
            maker.adopt_policy_version(info.policy_version)
            if info.policy_version:
                logger.warning(
                    "the generator serves policy version %d, but the actor replica was loaded from %s: "
                    "action_log_probs follow the loaded weights until the next policy update through this service",
                    info.policy_version, actor_path,
                )
            if vision is not None and not info.multimodal:
                logger.warning("the policy %s is vision-language but the generator does not accept images", actor_path)
        elif info.policy_version != policy.version:
            logger.warning(
                "the generator at %s is back at policy version %d while version %d is live here (it restarted): "
                "its samples carry their own version; send the current weights again with UpdateWeights",
                settings.generator_address, info.policy_version, policy.version,
            )

    upstream = UpstreamMonitor(
        generator, scorer, generator_address=settings.generator_address, scorer_address=settings.scorer_address,
        on_generator_info=generator_reached,
        settings=ProbeSettings(timeout_s=settings.upstream_probe_timeout_s, interval_s=settings.upstream_probe_interval_s,
                               backoff_max_s=settings.upstream_backoff_max_s),
    )
    servicer = ExperienceServicer(
        maker, tokenizer, settings.request_limits(), upstream.require_ready, settings.weights_staging_dir,
        settings.max_concurrent_streams, vision=vision, media_limits=settings.media_limits(),
    )
    running = await create_server(
        host=settings.host,
        port=settings.port,
        register=lambda server: experience_pb2_grpc.add_ExperienceServiceServicer_to_server(servicer, server),
        service_names=[SERVICE_NAME],
        max_message_bytes=settings.max_message_bytes,
        tls=settings.server_tls(),
        auth=settings.auth(),
    )
    watcher = asyncio.create_task(upstream.run(running.set_serving), name="upstream-monitor")
    logger.info(
        "experience service listening on %s:%d, NOT_SERVING until the generator (%s) and scorer (%s) answer",
        settings.host, running.port, settings.generator_address, settings.scorer_address,
    )
    return ExperienceService(running, upstream, watcher, (generator_channel, scorer_channel))


def serve(settings: ExperienceSettings) -> None:
    """Run the experience service until SIGTERM/SIGINT (blocking)."""

    async def main() -> None:
        service = await start_experience(settings)
        await serve_until_signalled(service.running, settings.grace_period_s, cleanup=service.close)

    asyncio.run(main())

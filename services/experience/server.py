"""Experience service entry: load actor/reference, serve, and watch the generator and scorer it depends on."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fastexp.security import ClientTLS
from fastexp.v1 import experience_pb2, experience_pb2_grpc
from services.common import metrics
from services.common.channels import open_channel
from services.common.dtypes import agreed_dtype, resolve_dtype
from services.common.errors import NotReady
from services.common.models import resolve_model
from services.common.security import read_tokens
from services.common.server import RunningServer, ServingGate, run_service, start_service
from services.common.weights import WeightsBlobs
from services.experience.api.servicer import ExperienceServicer
from services.experience.fleet.clients import EnvironmentClient, GeneratorClient, ScorerClient
from services.experience.fleet.cores import CoreShare
from services.experience.fleet.generator_fleet import GeneratorFleet
from services.experience.fleet.readiness import GeneratorInfo, UpstreamMonitor
from services.experience.gateway.agents import AgentRunner, AgentServer
from services.experience.gateway.app import create_app
from services.experience.gateway.core import Gateway
from services.experience.gateway.serving import RunningGateway, start_gateway
from services.experience.gateway.sessions import SessionRegistry
from services.experience.pipeline.episodes import EpisodeRunner, ObservationRenderer
from services.experience.pipeline.forwarder import ForwardModels
from services.experience.pipeline.maker import ExperienceMaker
from services.experience.runs.metrics import RUN_METRICS
from services.experience.runs.registry import ReplicaIdentity, RunRegistry
from services.experience.settings import ExperienceSettings
from services.experience.state.ledger import StoredLedger
from services.experience.state.statistics import StoredStatistics
from services.experience.state.store import StateStore
from services.experience.state.streams import StoredStreams
from services.experience.workers.adapters import AdapterForwards
from services.experience.workers.attention import plain_causal
from services.experience.workers.critic import ValueModel
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.vision import VisionProcessor

logger = logging.getLogger(__name__)

SERVICE_NAME = experience_pb2.DESCRIPTOR.services_by_name["ExperienceService"].full_name


@dataclass
class ExperienceService:
    """A running experience server, the tasks watching its dependencies, and what it must close."""

    running: RunningServer
    upstream: UpstreamMonitor
    fleet: GeneratorFleet
    watchers: tuple[asyncio.Task[None], ...]
    channels: tuple[grpc.aio.Channel, ...]
    sessions: SessionRegistry
    runs: RunRegistry
    gateway: RunningGateway | None = None  # the OpenAI-compatible gateway, when gateway_port is set
    agents: AgentRunner | None = None  # agent episodes through the gateway, when agents are configured
    cores: CoreShare | None = None  # the forwards' threads and those of engines sharing the host

    async def wait_ready(self, timeout_s: float | None = None) -> GeneratorInfo:
        """Return once the generator and scorer were reached (health SERVING).

        Raises:
            TimeoutError: not within ``timeout_s``; the message says what it waits for.
        """
        return await self.upstream.wait_ready(timeout_s)

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        if self.agents is not None:
            await self.agents.close()
        for watcher in self.watchers:
            watcher.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        if self.cores is not None:
            await self.cores.close()
        await self.fleet.close()
        for channel in self.channels:
            await channel.close()
        try:
            await self.runs.leave()  # this replica's stream slots are given back at once
        except Exception as error:  # noqa: BLE001 - the store is down: they stop counting after replica_ttl_s
            logger.warning("could not leave the state store: %s", error)
        self.runs.store.close()


@dataclass(frozen=True)
class _Policy:
    """What the experience service runs itself: the models, the policy's tokenizer and vision processor."""

    models: ForwardModels
    path: str  # the actor replica's folder
    tokenizer: Any
    vision: VisionProcessor | None  # None for a text-only policy
    dtype: str  # the one floating-point type of every actor tensor ("bfloat16", ...; "" where some differ)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id


def _load_policy(settings: ExperienceSettings) -> _Policy:
    """Load the actor replica, the reference, the critic (when set) and the policy's tokenizer/processor."""
    from transformers import AutoTokenizer

    actor_path = resolve_model(settings.actor_model)
    device = "cuda" if settings.device_map else settings.device  # a device_map spreads the models over the GPUs
    dtype = resolve_dtype(settings.dtype, device)
    logger.info("forward passes in %s on %s (dtype setting %s)", dtype, device, settings.dtype)
    placement = {"dtype": dtype, "device": settings.device, "device_map": settings.device_map}
    actor = LogProbModel.load(actor_path, **placement)
    reference = LogProbModel.load(resolve_model(settings.reference_model), **placement)
    critic = None
    if settings.critic_model:
        critic = ValueModel.load(resolve_model(settings.critic_model), **placement)
    # LoRA runs' adapters go on the actor's module: it holds the base the generator serves
    adapters = AdapterForwards(actor, settings.max_lora_rank) if settings.lora_runs else None
    # the shared-prompt layout's mask knows no sliding window or soft-capping: such models take the packed layout
    configs = [actor.module.config, reference.module.config] + ([critic.modules["critic"].config] if critic else [])
    share_prompt = settings.forward_share_prompt and all(plain_causal(config) for config in configs)
    if settings.forward_share_prompt and not share_prompt:
        logger.warning("forward_share_prompt off: a model has a sliding window, soft-capping or bidirectional layers")
    models = ForwardModels(actor, reference, critic, settings.forward_micro_batch_size, share_prompt, adapters)
    vision = VisionProcessor.load(actor_path)
    tokenizer = vision.tokenizer if vision is not None else AutoTokenizer.from_pretrained(actor_path)
    # a model may keep some tensors in float32 under a bf16 setting (transformers' _keep_in_fp32_modules): a sender
    # narrowing to one type would round those, so the service says a type only where every tensor has it
    held = agreed_dtype(*sorted({str(t.dtype).removeprefix("torch.") for t in actor.tensors().values()
                                 if t.is_floating_point()}))
    return _Policy(models, actor_path, tokenizer, vision, held)


def _on_generator_reached(maker: ExperienceMaker, policy: _Policy):
    """What the service does when the generator fleet first serves (the monitor's callback). Replicas that restart
    or join later are brought to the live version by the fleet itself."""

    def reached(info: GeneratorInfo, first: bool) -> None:
        if not first:
            return
        if maker.policy.version:  # the state store's live version, loaded at start: the fleet is brought to it
            return
        # no stream or update can have run yet (both need the generator), and the store has no version: the
        # generator's is the live one
        maker.adopt_policy_version(info.policy_version)
        if info.policy_version:
            logger.warning(
                "the generator serves policy version %d, but the actor replica was loaded from %s: "
                "action_log_probs follow the loaded weights until the next policy update through this service "
                "(and replicas that join are sent those weights)", info.policy_version, policy.path,
            )
        if policy.vision is not None and not info.multimodal:
            logger.warning("the policy %s is vision-language but the generator does not accept images", policy.path)

    return reached


def _episode_runner(
    settings: ExperienceSettings, policy: _Policy, fleet: GeneratorFleet, environment_channel: grpc.aio.Channel,
    upstream: UpstreamMonitor,
) -> EpisodeRunner | None:
    """Multi-turn episodes over the fleet and the scorer's environments; None for a policy whose chat template
    cannot render observations token-exactly (multi-turn requests are then refused)."""
    try:
        renderer = ObservationRenderer(policy.tokenizer)
    except (ValueError, TypeError) as error:  # no chat template, or one that is not prefix-stable
        logger.warning("multi-turn episodes are off: the policy's chat template cannot render observations (%s)",
                       error)
        return None
    environments = EnvironmentClient(environment_channel, settings.environment_step_timeout_s)
    return EpisodeRunner(fleet, environments, renderer, lambda: upstream.require_ready().max_model_len,
                         policy.tokenizer)


def _serve_gateway(
    settings: ExperienceSettings, policy: _Policy, fleet: GeneratorFleet, upstream: UpstreamMonitor,
    sessions: SessionRegistry,
) -> RunningGateway | None:
    """The OpenAI-compatible gateway over the fleet on ``gateway_port`` (None when unset)."""
    if settings.gateway_port is None:
        return None
    tokens = _gateway_tokens(settings)
    name = _gateway_model_name(settings, policy)
    gateway = Gateway(fleet, policy.tokenizer, name, lambda: upstream.require_ready().max_model_len,
                      settings.gateway_call_timeout_s)
    app = create_app(gateway, sessions, tokens, settings.gateway_max_body_bytes)
    running = start_gateway(app, settings.host, settings.gateway_port, settings.grace_period_s,
                            settings.tls_cert_file, settings.tls_key_file,
                            client_ca_file=settings.tls_client_ca_file)
    logger.info("OpenAI-compatible gateway on %s:%d (model %s)", settings.host, running.port, name)
    return running


def _agent_runner(
    settings: ExperienceSettings, policy: _Policy, sessions: SessionRegistry, gateway: RunningGateway | None
) -> AgentRunner | None:
    """Agent episodes through the gateway, when it runs and the operator configured ``agents`` (None otherwise)."""
    if gateway is None or not settings.agents:
        if settings.agents:
            logger.warning("agents are configured but gateway_port is not: agent episodes are off")
        return None
    scheme = "https" if settings.tls_cert_file else "http"
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base_url = settings.gateway_base_url or f"{scheme}://{host}:{gateway.port}/v1"  # this replica's own
    return AgentRunner({n: AgentServer(a.url, a.timeout_s) for n, a in settings.agents.items()}, sessions,
                       base_url, _gateway_model_name(settings, policy), policy.tokenizer)


def _gateway_model_name(settings: ExperienceSettings, policy: _Policy) -> str:
    """The model name the gateway serves (and agent sessions use): ``gateway_model_name`` or the policy's folder."""
    return settings.gateway_model_name or Path(policy.path).name


def _gateway_tokens(settings: ExperienceSettings) -> tuple[bytes, ...]:
    """The service's bearer tokens, call and admin (the gateway checks them like the gRPC port)."""
    files = [(settings.auth_tokens_file, "auth_tokens_file"), (settings.admin_tokens_file, "admin_tokens_file")]
    return tuple(token for path, name in files if path is not None for token in read_tokens(path, name))


def _core_share(settings: ExperienceSettings, fleet: GeneratorFleet) -> CoreShare:
    """The forward passes' CPU threads, and the engines' on a host they share (:mod:`services.experience.fleet.cores`)."""
    return CoreShare(fleet, engine_threads_sharing=settings.generator_cpu_threads_sharing,
                     forward_threads=settings.torch_threads, idle_forward_threads=settings.torch_threads_idle)


def _connect_replica(settings: ExperienceSettings, tls: ClientTLS | None, token: str | None):
    """Opens one generator replica's client (its own channel: the fleet routes, not gRPC's load balancer)."""

    def connect(address: str) -> GeneratorClient:
        channel = open_channel(address, settings.max_message_bytes, tls, token)
        return GeneratorClient(channel, settings.generate_timeout_s, settings.update_weights_timeout_s, address)

    return connect


async def start_experience(settings: ExperienceSettings) -> ExperienceService:
    """Load the actor, reference (and critic), serve, and watch the generator and scorer.

    Returns once the server is bound: health is NOT_SERVING (and ``MakeExperiences`` answers UNAVAILABLE naming
    what it waits for) until the generator and the scorer have answered, however long that takes; see
    :mod:`services.experience.fleet.readiness`. ``await service.wait_ready()`` waits for that.
    """
    import torch

    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    tls, token = settings.upstream_tls(), settings.upstream_token()
    scorer_channel = open_channel(settings.scorer_address, settings.max_message_bytes, tls, token)
    # episodes are sessions in one scorer process: their calls stay on one scorer replica (pick_first)
    environment_channel = open_channel(settings.scorer_address, settings.max_message_bytes, tls, token, "pick_first")
    fleet = GeneratorFleet(settings.generator_targets, _connect_replica(settings, tls, token), settings.fleet_settings())
    scorer = ScorerClient(scorer_channel, settings.score_timeout_s)
    policy = _load_policy(settings)
    generators = ", ".join(settings.generator_targets)
    upstream = UpstreamMonitor(
        fleet, scorer, generator_address=generators, scorer_address=settings.scorer_address,
        settings=settings.probe_settings(),
    )
    runs, ledger = await _open_state(settings)
    sessions = SessionRegistry()
    gateway = _serve_gateway(settings, policy, fleet, upstream, sessions)
    agents = _agent_runner(settings, policy, sessions, gateway)
    cores = _core_share(settings, fleet)
    maker = ExperienceMaker(
        fleet, scorer, policy.models, pad_token_id=policy.pad_token_id, runs=StoredStatistics(runs.store, settings.max_runs),
        max_groups_ahead=settings.max_groups_ahead, sync_timeout_s=settings.update_weights_timeout_s,
        episodes=_episode_runner(settings, policy, fleet, environment_channel, upstream),
        cores=cores, agents=agents,
        max_samples_in_flight=settings.max_samples_in_flight, ledger=ledger,
    )
    maker.on_policy_live(fleet.members.follow)
    try:  # the live versions in the store (a restart, or updates through other replicas) before anything serves
        await maker.catch_up()
    except NotReady as error:
        logger.warning("could not load the live versions yet (%s); streams wait for them", error)
    fleet.weight_source = maker.sync_replica
    fleet.members.live_adapters = maker.settled_adapters  # a replica lacking one is sent it before it serves
    upstream.on_generator_info = _on_generator_reached(maker, policy)
    streams = StoredStreams(runs.store, settings.stream_ttl_s)
    servicer = ExperienceServicer(
        maker, policy.tokenizer, settings.request_limits(), upstream, runs,
        settings.weights_staging_dir, settings.max_concurrent_streams, vision=policy.vision,
        media_limits=settings.media_limits(), checkpoint_roots=tuple(settings.checkpoint_roots),
        streams=streams, drain_margin_s=settings.drain_margin_s, ready_wait_s=settings.ready_wait_s,
        policy_dtype=policy.dtype,
    )
    RUN_METRICS.add(servicer)
    running = await start_service(
        settings, SERVICE_NAME, lambda server: experience_pb2_grpc.add_ExperienceServiceServicer_to_server(servicer, server)
    )
    running.on_stop = servicer.drain  # SIGTERM: streams hand over before the grace period ends
    metrics.POLICY_VERSION.labels("experience").set_function(lambda: maker.policy.version)
    for queue in ("scored", "forwarded"):
        metrics.QUEUE_DEPTH.labels(queue).set_function(lambda queue=queue: maker.queue_depth(queue))
    watchers = _watch(running, upstream, fleet, runs, maker, (ledger, streams), settings)
    logger.info(
        "experience service listening on %s:%d, NOT_SERVING until the generator (%s) and scorer (%s) answer",
        settings.host, running.port, generators, settings.scorer_address,
    )
    return ExperienceService(running, upstream, fleet, watchers, (scorer_channel, environment_channel), sessions,
                             runs, gateway, agents, cores)


def _watch(running: RunningServer, upstream: UpstreamMonitor, fleet: GeneratorFleet, runs: RunRegistry,
           maker: ExperienceMaker, state: tuple[StoredLedger, StoredStreams],
           settings: ExperienceSettings) -> tuple[asyncio.Task, ...]:
    """The service's background tasks: the generator fleet, readiness (SERVING while the generator and scorer are
    reached and the state store answers), the store's heartbeat, and following the live versions."""
    gate = ServingGate(running, ("upstream", "state store"), initially=("state store",))  # migrated: it answered
    return (
        asyncio.create_task(fleet.run(), name="generator-fleet"),
        asyncio.create_task(upstream.run(gate.setter("upstream")), name="upstream-monitor"),
        asyncio.create_task(_probe_on_changes(fleet, upstream), name="fleet-changes"),
        asyncio.create_task(runs.run_heartbeats(gate.setter("state store")), name="state-heartbeat"),
        asyncio.create_task(_follow_ledger(maker, *state, settings), name="state-follower"),
    )


async def _probe_on_changes(fleet: GeneratorFleet, upstream: UpstreamMonitor) -> None:
    """While NOT_SERVING, readiness is probed at every change of the fleet's replicas (one serving again, a version
    followed), not after its backoff: a stream waiting for it goes on at once."""
    while True:
        await fleet.members.changes.next().wait()
        if not upstream.ready:
            upstream.probe_soon()


async def _follow_ledger(maker: ExperienceMaker, ledger: StoredLedger, streams: StoredStreams,
                         settings: ExperienceSettings) -> None:
    """Every ``state_poll_interval_s``: load the live versions made through other replicas (the generator fleet
    follows the live policy version: ``WeightSync.on_policy_live``), and now and then collect the blobs no live
    version names and the stream records unused for ``stream_ttl_s``."""
    polls, collect_every = 0, max(1, int(60.0 / settings.state_poll_interval_s))
    while True:
        try:
            await maker.catch_up()
            if polls % collect_every == 0:
                await ledger.collect(settings.weights_collect_grace_s)
                await streams.collect()
        except Exception as error:  # noqa: BLE001 - the store or a blob is unavailable: streams report it
            logger.warning("following the live versions failed: %s", error)
        polls += 1
        await asyncio.sleep(settings.state_poll_interval_s)


async def _open_state(settings: ExperienceSettings) -> tuple[RunRegistry, StoredLedger]:
    """The state store (migrated, waiting for it as long as it takes), its runs and its version ledger."""
    store = StateStore(settings.state_store_url(), timeout_s=settings.state_timeout_s, pool_size=settings.state_pool_size)
    await _migrate(store)
    runs = RunRegistry(settings.run_limits(), store, ReplicaIdentity.new(socket.gethostname(), settings.replica_ttl_s))
    return runs, StoredLedger(store, WeightsBlobs(settings.weights_dir), claim_s=settings.update_weights_timeout_s + 60)


async def _migrate(store: StateStore, retry_s: float = 2.0) -> None:
    """Bring the state store's schema up to date, waiting for the database as long as it takes (a Compose or
    Kubernetes database may start after this service): each failed try is logged."""
    while True:
        try:
            await asyncio.to_thread(store.migrate)
            return
        except NotReady as error:
            logger.warning("%s; trying again in %.0f s", error, retry_s)
            await asyncio.sleep(retry_s)


def serve(settings: ExperienceSettings) -> None:
    """Run the experience service until SIGTERM/SIGINT (blocking)."""

    async def start() -> tuple[RunningServer, Callable[[], Awaitable[None]]]:
        service = await start_experience(settings)
        return service.running, service.close

    run_service(start, settings.grace_period_s)

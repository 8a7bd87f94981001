"""The experience service's typed settings (precedence and parsing: :mod:`services.common.settings`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import SettingsConfigDict

from fastexp.security import ClientTLS
from services.common.dtypes import DtypeSetting
from services.common.models import SMOLLM2_ALIAS
from services.common.security import AuthInterceptor, read_tokens
from services.common.settings import GenerationLimits
from services.experience.fleet.readiness import ProbeSettings
from services.experience.fleet.replicas import FleetSettings
from services.experience.runs.limits import (
    DEFAULT_LORA_TARGET_MODULES,
    DEFAULT_MAX_LORA_RANK,
    OperatorLimits,
    RunLimits,
)


class AgentEndpoint(BaseModel):
    """An agent server the operator runs: where it answers episodes, and the deadline of one episode."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="http(s) URL the experience service POSTs each episode to")
    timeout_s: float = Field(300.0, gt=0, description="deadline of one episode (the agent's call and its session)")


class ExperienceSettings(GenerationLimits):
    """The experience service: where the generator and scorer are, and the models it runs itself."""

    section: ClassVar[str] = "experience"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_EXPERIENCE_", extra="forbid")

    port: int = Field(50053, ge=0, le=65535)
    generator_address: str = Field(
        "127.0.0.1:50051", description="host:port of the generator service (a fleet of one; see generator_addresses)"
    )
    generator_addresses: list[str] = Field(
        default_factory=list,
        description="the generator fleet: host:port of each replica, or dns:///name:port for every address a name "
        "resolves to (a Kubernetes headless Service), resolved again every generator_discovery_interval_s; JSON in "
        "the environment. Empty: generator_address alone",
    )
    generator_discovery_interval_s: float = Field(10.0, gt=0, description="how often dns:/// generator targets are resolved again")
    generator_max_samples_in_flight: int | None = Field(
        None, ge=1, description="most samples one generator replica runs for this service at once (its engine's "
        "batch capacity, e.g. vLLM's max_num_seqs): further groups wait and go to the replica that frees up first, "
        "which keeps replicas busy to the end of a round (None: all of a round's groups are placed at once)",
    )
    generator_down_after_failures: int = Field(
        2, ge=1, description="failed probes in a row that take a serving generator replica out (its work is rerouted)"
    )
    scorer_address: str = Field("127.0.0.1:50052", description="host:port of the scorer service")
    actor_model: str = Field(SMOLLM2_ALIAS, description="actor replica for action_log_probs (same as policy)")
    reference_model: str = Field(SMOLLM2_ALIAS, description="frozen reference for base_action_log_probs")
    critic_model: str | None = Field(
        None, description="critic checkpoint folder (backbone + value head) for values and the gae estimator"
    )
    max_runs: int = Field(
        1024, ge=1, description="runs the service holds: created runs (CreateRun past it: RESOURCE_EXHAUSTED), and "
        "run ids whose reward statistics and kl_coef are kept (LRU)",
    )
    run_default_max_streams: int = Field(
        8, ge=1, description="a run's max_streams when CreateRun leaves it 0 (a run may ask up to "
        "max_concurrent_streams; capped there)",
    )
    run_default_weight: int = Field(1, ge=1, description="a run's share weight when CreateRun leaves it 0")
    run_max_weight: int = Field(100, ge=1, description="largest share weight a run may ask for")
    lora_runs: bool = Field(True, description="accept LoRA runs (CreateRun with lora): their adapters are loaded on "
                                              "the actor's module, about 22 MB each at rank 16 on SmolLM2-135M")
    max_lora_rank: int = Field(DEFAULT_MAX_LORA_RANK, ge=1, description="largest LoRA rank a run may ask for")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES), min_length=1,
        description="modules a LoRA run may adapt (peft target_modules names; default the attention and MLP "
        "projections); JSON in the environment",
    )
    dtype: DtypeSetting = Field(
        "auto", description="the forward passes' floating-point type on `device`; auto: bfloat16 where the device "
        "computes it natively, float32 where it does not (services.common.dtypes), chosen at start and logged"
    )
    device: str = Field("cpu", description="torch device for actor/reference forward passes")
    device_map: str | None = Field(
        None, description="accelerate device_map (auto, balanced, sequential) spreading the actor, reference and "
        "critic backbone over every visible GPU, for models larger than one GPU (None: each on `device`)",
    )
    forward_micro_batch_size: int = Field(8, ge=1, description="rows per actor/reference/critic forward pass (packed or padded)")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads of the forward passes (None: torch's default, one per core); on a host "
        "whose cores a CPU inference engine also uses, fewer avoid oversubscribing them",
    )
    torch_threads_idle: int | None = Field(
        None, ge=1, description="CPU threads of a forward pass that starts while none of this service's generation "
        "is in flight (a CPU engine on this host then leaves its cores free: the launcher sets every core); None: "
        "torch_threads always",
    )
    generator_cpu_threads_sharing: int = Field(
        0, ge=0, description="threads of a CPU engine on this host's cores (the generator lists the feature "
        "cpu-threads) while forward passes wait or run; every core it is bound to otherwise, so generation gets "
        "the host while the forwards have nothing to do (services.experience.fleet.cores). 0: engines keep their "
        "threads (the launcher sets half the cores)",
    )
    forward_share_prompt: bool = Field(
        True, description="packed forwards (packing_samples) compute each prompt group's prompt once, not n times"
    )
    max_concurrent_streams: int = Field(
        64, ge=1, description="MakeExperiences streams served at once; more get RESOURCE_EXHAUSTED"
    )
    max_groups_ahead: int = Field(
        64, ge=1,
        description="backpressure: most prompt groups of one stream generated or generating and not yet streamed "
        "(at least one batch's groups; the whole request with normalization_scope ROLLOUT)",
    )
    max_samples_in_flight: int | None = Field(
        None, ge=1,
        description="the generator fleet's capacity in samples, shared among runs by weighted fair share (their "
        "weight limit): past it a group waits for another's generation to end (None: unbounded, every group goes "
        "at once; set it to about the fleet's engine batch size when several runs share a deployment, e.g. "
        "generator_max_samples_in_flight x replicas: that one places admitted groups on replicas, this one decides "
        "whose groups are admitted)",
    )
    generate_timeout_s: float = Field(1800.0, gt=0, description="deadline of one Generate stream")
    score_timeout_s: float = Field(120.0, gt=0, description="deadline of one Score call")
    environment_step_timeout_s: float = Field(
        120.0, gt=0, description="deadline of one call to the scorer's environments (an episode's start or step)"
    )
    # The generator and scorer are waited for as long as the service runs (services.experience.fleet.readiness).
    upstream_probe_timeout_s: float = Field(5.0, gt=0, description="deadline of one readiness probe of the generator or scorer")
    upstream_probe_interval_s: float = Field(2.0, gt=0, description="time between probes of the generator while ready")
    upstream_backoff_max_s: float = Field(
        5.0, gt=0, description="largest wait between probes while a dependency is unreachable (doubling from 0.25 s)"
    )
    update_weights_timeout_s: float = Field(
        600.0, gt=0, description="deadline of forwarding one policy update to the generator (capped by the caller's)"
    )
    state_url: str = Field(
        default_factory=lambda: f"sqlite:///{Path.home() / '.local' / 'state' / 'fastexp' / 'experience.db'}",
        description="the durable state every experience replica shares (runs, owners, versions, statistics, stream "
        "slots): sqlite:///path (the embedded default: one node, a file that survives restarts) or "
        "postgresql://user:password@host:port/db (several replicas). Migrated at start",
    )
    weights_dir: Path = Field(
        default_factory=lambda: Path.home() / ".local" / "state" / "fastexp" / "weights",
        description="where each version's weights are kept by reference (content-addressed blobs named by their "
        "SHA-256): a folder every experience replica mounts (a shared volume). Blobs no live version names are "
        "collected after weights_collect_grace_s",
    )
    weights_collect_grace_s: float = Field(600.0, ge=0, description="age past which a blob no live version names is "
                                                                    "removed (a replica may still be loading it)")
    state_poll_interval_s: float = Field(
        2.0, gt=0, description="how often this replica reads the live versions in the state store and loads those "
        "made through other replicas (a stream also checks when it starts)",
    )
    state_password_file: Path | None = Field(
        None, description="a file whose first line is the state store's password (set: it replaces the password of "
        "state_url, which then need not carry one)",
    )
    state_timeout_s: float = Field(10.0, gt=0, description="deadline of one call to the state store (connect, "
                                                              "statement, lock wait); past it: UNAVAILABLE naming it")
    state_pool_size: int = Field(4, ge=1, le=64, description="connections to the state store (its calls queue for them: "
                                                             "any number of streams never needs more)")
    replica_ttl_s: float = Field(30.0, gt=0, description="an experience replica silent in the store this long (killed) "
                                                         "no longer holds its runs' stream slots")
    stream_ttl_s: float = Field(86400.0, gt=0, description="a resumable stream's record (stream_id) is kept this long "
                                                           "after its last open or batch; a resume after it starts afresh")
    ready_wait_s: float = Field(
        10.0, ge=0, description="a stream or weight update that arrives while the service is NOT_SERVING (e.g. for the "
        "moment it follows an update made through another replica) waits this long, half its deadline at most, for "
        "it to serve again before UNAVAILABLE",
    )
    drain_margin_s: float = Field(
        5.0, ge=0, description="SIGTERM: streams still open this long before grace_period_s ends are handed over "
        "(UNAVAILABLE, trailer fastexp-drained) for their clients to resume on another replica",
    )
    weights_staging_dir: str | None = Field(
        None, description="where streamed weight updates are staged on disk (None: the system temp folder)"
    )
    upstream_tls_ca_file: Path | None = Field(
        None, description="CA that signed the generator's and scorer's certificates (set: connect with TLS)"
    )
    upstream_tls_cert_file: Path | None = Field(None, description="this service's client certificate (mTLS)")
    upstream_tls_key_file: Path | None = Field(None, description="this service's client key (mTLS)")
    upstream_tls_server_name: str | None = Field(None, description="name to check in their certificates")
    upstream_token_file: Path | None = Field(
        None, description="bearer token sent to the generator and scorer (an admin token: it forwards updates)"
    )
    gateway_port: int | None = Field(
        None, ge=0, le=65535, description="the OpenAI-compatible gateway's port on `host` (/v1/chat/completions, "
        "/v1/completions; agent episodes' sessions); None: no gateway. Same TLS and bearer tokens as the gRPC port",
    )
    gateway_model_name: str | None = Field(
        None, description="the model name the gateway serves outside sessions (None: the actor folder's name)"
    )
    gateway_base_url: str | None = Field(
        None, pattern=r"^https?://[^/\s]+(/\S*)?$", description="the gateway's URL as agent servers reach THIS "
        "replica (`http(s)://<address>:<gateway_port>/v1`, e.g. the pod's IP); None: `<host>` (127.0.0.1 for a "
        "service bound to all interfaces). An episode's session lives in the replica that opened it: with several "
        "replicas, each advertises its own address, never a Service in front of them",
    )
    gateway_call_timeout_s: float = Field(300.0, gt=0, description="deadline of one gateway call's generation")
    gateway_max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest gateway request body; "
                                        "bigger ones are 413, unread (after the key is checked)")
    agents: dict[str, AgentEndpoint] = Field(
        default_factory=dict, description="agent servers requests may name (name -> url, timeout_s); a request "
        "names one, never a URL. Needs gateway_port (the agents call the model through it)",
    )

    def state_store_url(self) -> str:
        """``state_url`` with the password of ``state_password_file`` when set.

        Raises:
            SecurityConfigError: the password file is unreadable or empty.
        """
        if self.state_password_file is None:
            return self.state_url
        from sqlalchemy.engine import make_url

        password = read_tokens(self.state_password_file, "state_password_file")[0].decode()
        return make_url(self.state_url).set(password=password).render_as_string(hide_password=False)

    @property
    def generator_targets(self) -> list[str]:
        """The generator fleet's targets: ``generator_addresses``, else ``[generator_address]``."""
        return list(self.generator_addresses) or [self.generator_address]

    def fleet_settings(self) -> FleetSettings:
        """How the generator fleet is watched and kept in step, as the plain record the fleet takes."""
        return FleetSettings(
            probe=self.probe_settings(), down_after_failures=self.generator_down_after_failures,
            discovery_interval_s=self.generator_discovery_interval_s, sync_timeout_s=self.update_weights_timeout_s,
            max_samples_in_flight=self.generator_max_samples_in_flight,
        )

    def auth(self) -> AuthInterceptor | None:
        """The bearer-token check (:meth:`ServiceSettings.auth`), with ``UpdateWeights`` open to call tokens on calls
        that name a run (``fastexp-run-id``): the servicer lets the run's owner through, and only an admin token
        for a base-model run, whose weights are the deployment's.

        Raises:
            SecurityConfigError: a token file is unreadable or empty.
        """
        interceptor = super().auth()
        return interceptor.scoped_to_runs(frozenset({"UpdateWeights"})) if interceptor is not None else None

    def run_limits(self) -> OperatorLimits:
        """The limits on runs, as the plain record the run registry takes: a run's max_streams up to
        max_concurrent_streams, its max_groups_ahead and max_tokens_per_request up to (and by default) the
        service's own, its weight up to run_max_weight."""
        return OperatorLimits(
            max_runs=self.max_runs,
            defaults=RunLimits(
                max_streams=min(self.run_default_max_streams, self.max_concurrent_streams),
                max_groups_ahead=self.max_groups_ahead, max_tokens_per_request=self.max_tokens_per_request,
                weight=min(self.run_default_weight, self.run_max_weight),
            ),
            ceilings=RunLimits(
                max_streams=self.max_concurrent_streams, max_groups_ahead=self.max_groups_ahead,
                max_tokens_per_request=self.max_tokens_per_request, weight=self.run_max_weight,
            ),
            max_lora_rank=self.max_lora_rank, lora_target_modules=tuple(self.lora_target_modules),
        )

    def probe_settings(self) -> ProbeSettings:
        """How the generator and scorer are watched, as the plain record the monitor takes."""
        return ProbeSettings(
            timeout_s=self.upstream_probe_timeout_s, interval_s=self.upstream_probe_interval_s,
            backoff_max_s=self.upstream_backoff_max_s,
        )

    def upstream_tls(self) -> ClientTLS | None:
        """TLS for the calls to the generator and scorer, or ``None`` for plaintext."""
        if self.upstream_tls_ca_file is None:
            return None
        return ClientTLS(self.upstream_tls_ca_file, self.upstream_tls_cert_file, self.upstream_tls_key_file,
                         self.upstream_tls_server_name)

    def upstream_token(self) -> str | None:
        """The bearer token for the generator and scorer (the file's first token), or ``None``.

        Raises:
            SecurityConfigError: the file is unreadable or empty.
        """
        if self.upstream_token_file is None:
            return None
        return read_tokens(self.upstream_token_file, "upstream_token_file")[0].decode()

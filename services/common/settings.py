"""Typed settings for the three services, parsed once at the edge.

Precedence, highest first: explicit overrides (CLI flags) > environment (``FASTEXP_<SERVICE>_<FIELD>``) > the
service's section of a YAML file (``generator:``, ``scorer:``, ``experience:``) > defaults. Validation reports
every bad field at once (pydantic). Nothing here is read at import time.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import yaml
from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common.media import MediaLimits
from services.common.models import SMOLLM2_ALIAS
from services.common.sampling import RequestLimits
from services.common.security import AuthInterceptor, ClientTLS, ServerTLS, read_tokens
from services.scorer.config import RecipeEntry, SourceConfig, config_problems, default_sources

_yaml_section: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("_yaml_section", default=None)


class _YamlSectionSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_yaml_section.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_section.get() or {})


class ServiceSettings(BaseSettings):
    """Fields every gRPC server has."""

    section: ClassVar[str] = ""

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one")
    grace_period_s: float = Field(10.0, ge=0, description="SIGTERM: time in-flight calls get to finish")
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest gRPC message in or out")
    log_level: str = Field("INFO", description="Python logging level")
    log_format: Literal["text", "json"] = Field("text", description="json: one object per line, with request_id")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port on the same host (None: no metrics endpoint)"
    )

    # Security (services.common.security): TLS when a certificate is set, mTLS with a client CA, bearer tokens
    # when a token file is set. Files are PEM / one token per line (e.g. mounted Kubernetes Secrets).
    tls_cert_file: Path | None = Field(None, description="server certificate chain (PEM); set: serve TLS only")
    tls_key_file: Path | None = Field(None, description="server private key (PEM)")
    tls_client_ca_file: Path | None = Field(None, description="CA of accepted client certificates (PEM): mTLS")
    auth_tokens_file: Path | None = Field(None, description="bearer tokens that may call (not UpdateWeights)")
    admin_tokens_file: Path | None = Field(None, description="bearer tokens that may call everything")

    # env_parse_none_str: FASTEXP_GENERATOR_KV_CACHE_MEMORY_BYTES=null sets an optional field to None
    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__", env_parse_none_str="null")

    @model_validator(mode="after")
    def _tls_files_pair_up(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mTLS) needs tls_cert_file and tls_key_file")
        return self

    def server_tls(self) -> ServerTLS | None:
        """The server's TLS files, or ``None`` for plaintext."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return ServerTLS(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    def auth(self) -> AuthInterceptor | None:
        """The bearer-token check, or ``None`` when no token file is set.

        Raises:
            SecurityConfigError: a token file is unreadable or empty.
        """
        if self.auth_tokens_file is None and self.admin_tokens_file is None:
            return None
        call = read_tokens(self.auth_tokens_file, "auth_tokens_file") if self.auth_tokens_file else ()
        admin = read_tokens(self.admin_tokens_file, "admin_tokens_file") if self.admin_tokens_file else ()
        return AuthInterceptor(call, admin)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSectionSource(settings_cls)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Self:
        """Build the settings from ``overrides`` (``None`` values ignored), the environment and ``config_file``.

        Raises:
            pydantic.ValidationError: listing every invalid field.
            FileNotFoundError: ``config_file`` does not exist.
        """
        section: dict[str, Any] = {}
        if config_file is not None:
            document = yaml.safe_load(Path(config_file).read_text()) or {}
            section = document.get(cls.section) or {}
        token = _yaml_section.set(section)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _yaml_section.reset(token)


class _GenerationLimits(ServiceSettings):
    """Request limits shared by the services that accept generation requests."""

    max_prompts_per_request: int = Field(4096, ge=1)
    max_samples_per_prompt: int = Field(256, ge=1)
    max_new_tokens_limit: int = Field(8192, ge=1, description="largest max_new_tokens a request may ask for")
    default_max_new_tokens: int = Field(256, ge=1, description="max_new_tokens when a request leaves it 0")
    # multimodal prompts (vision-language policies only)
    max_images_per_prompt: int = Field(8, ge=0, description="images one prompt may carry")
    max_videos_per_prompt: int = Field(2, ge=0, description="videos one prompt may carry")
    max_video_frames: int = Field(64, ge=1, description="frames one video may carry")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="pixel budget (width * height) of one image or video frame, checked before decoding"
    )

    def media_limits(self) -> MediaLimits:
        """The multimodal limits as the plain record the media decoder takes."""
        return MediaLimits(
            max_images_per_prompt=self.max_images_per_prompt,
            max_videos_per_prompt=self.max_videos_per_prompt,
            max_video_frames=self.max_video_frames,
            max_image_pixels=self.max_image_pixels,
        )

    def request_limits(self) -> RequestLimits:
        """These four limits as the plain record the request validators take."""
        return RequestLimits(
            max_prompts_per_request=self.max_prompts_per_request,
            max_samples_per_prompt=self.max_samples_per_prompt,
            max_new_tokens_limit=self.max_new_tokens_limit,
            default_max_new_tokens=self.default_max_new_tokens,
        )


class GeneratorSettings(_GenerationLimits):
    """The generator service: which model, which engine, and request limits."""

    section: ClassVar[str] = "generator"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_GENERATOR_", extra="forbid")

    port: int = Field(50051, ge=0, le=65535)
    model: str = Field(SMOLLM2_ALIAS, description="model folder, hub id, or the embedded default's alias")
    backend: Literal["auto", "vllm", "hf"] = Field("auto", description="auto: vLLM when importable, else HF")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: int = Field(2048, ge=16, description="most prompt + response tokens per sequence")
    seed: int = Field(0, description="engine seed")
    kv_cache_memory_bytes: int | None = Field(
        2 * 1024**3, ge=1, description="vLLM KV-cache size; on CPU this is host memory. None: use the utilization"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM memory fraction if no KV size")
    enforce_eager: bool = Field(True, description="vLLM: skip graph compilation (faster start, slower steps)")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM: most sequences per scheduler step (None: vLLM's default)")
    hf_max_batch_size: int = Field(32, ge=1, description="HF backend: sequences per generate() call")
    weights_staging_dir: str | None = Field(
        None, description="where streamed weight updates are staged on disk (None: the system temp folder)"
    )


class ScorerSettings(ServiceSettings):
    """The scorer service: its reward sources, how they combine, and its limits (see :mod:`services.scorer.config`)."""

    section: ClassVar[str] = "scorer"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_SCORER_", extra="forbid")

    port: int = Field(50052, ge=0, le=65535)
    sources: list[SourceConfig] = Field(
        default_factory=default_sources, description="named reward sources (model, similarity, remote, rule)"
    )
    recipes: dict[str, list[RecipeEntry]] = Field(
        default_factory=dict,
        description="label -> [(type, source, weight)]; 'default' covers other labels. Empty: the one source",
    )
    reward_fn: str | None = Field(
        None, description="import path of reward_fn(model_reward_list, labels, queries, refs, label_map)"
    )
    reward_fn_label_map: dict[str, int] = Field(
        default_factory=dict, description="source name -> its index in reward_fn's model_reward_list"
    )
    max_queries_per_request: int = Field(65536, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        problems = config_problems(self.sources, self.recipes, self.reward_fn, self.reward_fn_label_map)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RewardServerSettings(ScorerSettings):
    """The reference HTTP reward server (OpenRLHF protocol) over the same sources: ``reward_server:`` section."""

    section: ClassVar[str] = "reward_server"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_REWARD_SERVER_", extra="forbid")

    port: int = Field(8000, ge=0, le=65535)


class ExperienceSettings(_GenerationLimits):
    """The experience service: where the generator and scorer are, and the models it runs itself."""

    section: ClassVar[str] = "experience"
    model_config = SettingsConfigDict(env_prefix="FASTEXP_EXPERIENCE_", extra="forbid")

    port: int = Field(50053, ge=0, le=65535)
    generator_address: str = Field("127.0.0.1:50051", description="host:port of the generator service")
    scorer_address: str = Field("127.0.0.1:50052", description="host:port of the scorer service")
    actor_model: str = Field(SMOLLM2_ALIAS, description="actor replica for action_log_probs (same as policy)")
    reference_model: str = Field(SMOLLM2_ALIAS, description="frozen reference for base_action_log_probs")
    critic_model: str | None = Field(
        None, description="critic checkpoint folder (backbone + value head) for values and the gae estimator"
    )
    max_runs: int = Field(1024, ge=1, description="runs whose reward statistics and kl_coef are kept (LRU)")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = Field("cpu", description="torch device for actor/reference forward passes")
    forward_micro_batch_size: int = Field(8, ge=1, description="rows per actor/reference/critic forward pass (packed or padded)")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads of the forward passes (None: torch's default, one per core); on a host "
        "whose cores a CPU inference engine also uses, fewer avoid oversubscribing them",
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
    generate_timeout_s: float = Field(1800.0, gt=0, description="deadline of one Generate stream")
    score_timeout_s: float = Field(120.0, gt=0, description="deadline of one Score call")
    # The generator and scorer are waited for as long as the service runs (services.experience.upstream).
    upstream_probe_timeout_s: float = Field(5.0, gt=0, description="deadline of one readiness probe of the generator or scorer")
    upstream_probe_interval_s: float = Field(2.0, gt=0, description="time between probes of the generator while ready")
    upstream_backoff_max_s: float = Field(
        5.0, gt=0, description="largest wait between probes while a dependency is unreachable (doubling from 0.25 s)"
    )
    update_weights_timeout_s: float = Field(
        600.0, gt=0, description="deadline of forwarding one policy update to the generator (capped by the caller's)"
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

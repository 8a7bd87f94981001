"""What every service's typed settings share, parsed once at the edge; each service owns its settings class
(``services/<service>/settings.py``).

Precedence, highest first: explicit overrides (CLI flags) > environment (``FASTEXP_<SERVICE>_<FIELD>``) > the
service's section of a YAML file (``generator:``, ``scorer:``, ``experience:``, ``reward_server:``) > defaults. Validation reports
every bad field at once (pydantic). Nothing here is read at import time.
"""

from __future__ import annotations

import contextvars
import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import yaml
from pydantic import Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common.media import MediaLimits
from services.common.sampling import DEFAULT_MAX_TOKENS_PER_REQUEST, RequestLimits
from services.common.security import AuthInterceptor, ServerTLS, read_tokens

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
    insecure: bool = Field(
        False, description="serve a non-loopback host without TLS and without tokens (refused at start otherwise; "
        "logged as a warning when set)",
    )

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

    def secured(self) -> bool:
        """Whether callers must present TLS or a bearer token (a certificate or a token file is set)."""
        return self.tls_cert_file is not None or self.auth_tokens_file is not None or self.admin_tokens_file is not None

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


class GenerationLimits(ServiceSettings):
    """Request limits shared by the services that accept generation requests and weight updates (generator and
    experience)."""

    max_prompts_per_request: int = Field(4096, ge=1)
    max_samples_per_prompt: int = Field(256, ge=1)
    max_new_tokens_limit: int = Field(8192, ge=1, description="largest max_new_tokens a request may ask for")
    default_max_new_tokens: int = Field(256, ge=1, description="max_new_tokens when a request leaves it 0")
    max_tokens_per_request: int = Field(
        DEFAULT_MAX_TOKENS_PER_REQUEST, ge=1,
        description="cap on prompts x n_samples_per_prompt x max_new_tokens of one request (RESOURCE_EXHAUSTED over it)",
    )
    checkpoint_roots: list[Path] = Field(
        default_factory=list, description="folders an UpdateWeights checkpoint_dir may be under (symlinks and '..' "
        "resolved); empty: checkpoint_dir updates are refused. JSON in the environment",
    )
    # multimodal prompts (vision-language policies only)
    max_images_per_prompt: int = Field(8, ge=0, description="images one prompt may carry")
    max_videos_per_prompt: int = Field(2, ge=0, description="videos one prompt may carry")
    max_video_frames: int = Field(64, ge=1, description="frames one video may carry")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="pixel budget (width * height) of one image or video frame, checked before decoding"
    )
    max_request_pixels: int = Field(
        64 * 1024 * 1024, ge=1, description="pixel budget of one request's images and video frames together, checked "
        "before decoding (RESOURCE_EXHAUSTED over it)",
    )

    def media_limits(self) -> MediaLimits:
        """The multimodal limits as the plain record the media decoder takes."""
        return MediaLimits(**{field.name: getattr(self, field.name) for field in dataclasses.fields(MediaLimits)})

    def request_limits(self) -> RequestLimits:
        """These four limits as the plain record the request validators take."""
        return RequestLimits(**{field.name: getattr(self, field.name) for field in dataclasses.fields(RequestLimits)})

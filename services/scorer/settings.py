"""The scorer service's typed settings (precedence and parsing: :mod:`services.common.settings`)."""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings
from services.scorer.config import (
    EnvironmentConfig,
    RecipeEntry,
    SourceConfig,
    config_problems,
    default_environments,
    default_sources,
)
from services.scorer.sandbox import SandboxSettings


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
    environments: list[EnvironmentConfig] = Field(
        default_factory=default_environments,
        description="multi-turn environments requests may name (default: math_feedback, python_tool)",
    )
    environment_workers: int = Field(2, ge=1, description="worker processes verifying environments' answers")
    max_episodes: int = Field(4096, ge=1, description="episodes open at once; more get RESOURCE_EXHAUSTED")
    sandbox: SandboxSettings = Field(
        default_factory=SandboxSettings, description="where tool code runs (bwrap, or a remote sandbox)"
    )

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
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="largest request body; bigger ones are 413, "
                                                                       "unread (checked after the bearer token)")

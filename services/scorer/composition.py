"""Several reward sources as one reward: recipes pick the sources per sample, a sum or ``reward_fn`` combines them.

Stages of :meth:`RewardComposer.score` (LightRFT's RewardComputationEngine, with its filtering engine finished):

1. **Gather**: each item's recipe is ``recipes[label]``, else ``recipes["default"]``; a source runs only on the
   items whose recipe names it with a non-zero weight (an item's label without a recipe is INVALID_ARGUMENT).
2. **Process**: the needed sources score their items concurrently; each source's failures take its
   ``fallback_reward`` where one is configured (:func:`~services.scorer.scorer.apply_fallback`).
3. **Aggregate**: ``reward = Σ weight · reward_source`` over the recipe, or, with ``reward_fn``, whatever it returns
   for ``model_reward_list`` (one (N,) float32 tensor per source in ``reward_fn_label_map`` order; 0.0 where a
   source did not run on an item, as in LightRFT).

An item that any of its needed sources failed on keeps NaN as reward and gets an error naming the sources; it is
never silently zero. Metrics: ``<source>/reward`` and ``<source>/<metric>`` for every source (NaN where it did not
run), ``<source>/failed`` (0/1), plus what ``reward_fn`` returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.metrics import REWARD_SOURCE_SECONDS
from services.scorer.config import (
    DEFAULT_RECIPE,
    JudgeConfig,
    LocalModelConfig,
    RemoteConfig,
    RuleConfig,
    SimilarityConfig,
    SourceConfig,
)
from services.scorer.judges.source import JudgeScorer
from services.scorer.models import LocalModelScorer, SimilarityScorer
from services.scorer.outbound.breaker import Breaker
from services.scorer.outbound.cache import build_cache, fingerprint
from services.scorer.outbound.cached_source import CachingSource
from services.scorer.remote import RemoteScorer
from services.scorer.rules import RuleScorer, import_callable
from services.scorer.scorer import (
    NO_DEADLINE,
    RewardSource,
    ScoreItem,
    SourceScores,
    apply_fallback,
    checked_rewards,
)
from services.scorer.settings import ScorerSettings

logger = logging.getLogger(__name__)

#: ``reward_fn(model_reward_list, labels, queries, refs, label_map) -> rewards | (rewards, {name: (N,)})``
RewardFn = Callable[..., object]


class ConfigError(Exception):
    """The scorer's configuration names something that does not exist; the message lists every such name."""


class RewardComposer:
    """Runs the configured sources per recipe and combines their rewards (see module docs).

    Args:
        sources: the reward sources, in configuration order.
        fallbacks: source name -> ``fallback_reward`` (``None``: failures stay failures).
        recipes: label -> ``[(source name, weight)]``; ``"default"`` covers labels without their own.
        reward_fn: optional aggregation function; ``label_map`` orders its ``model_reward_list``.
    """

    def __init__(
        self,
        sources: Sequence[RewardSource],
        fallbacks: Mapping[str, float | None],
        recipes: Mapping[str, Sequence[tuple[str, float]]],
        reward_fn: RewardFn | None = None,
        label_map: Mapping[str, int] | None = None,
    ) -> None:
        self._sources = {source.name: source for source in sources}
        self._fallbacks = dict(fallbacks)
        self._recipes = {label: tuple(entries) for label, entries in recipes.items()}
        self._reward_fn = reward_fn
        self._label_map = dict(label_map or {name: i for i, name in enumerate(self._sources)})

    @property
    def source_names(self) -> list[str]:
        """The configured sources, in order."""
        return list(self._sources)

    def breakers(self) -> dict[str, Breaker]:
        """The circuit breakers of the sources that have one (remote, judge), by source name."""
        found = {name: getattr(source, "breaker", None) for name, source in self._sources.items()}
        return {name: breaker for name, breaker in found.items() if breaker is not None}

    async def start(self) -> None:
        """Start every source (load models, spawn rule workers, open HTTP pools).

        Raises:
            ConfigError: naming every source that could not start (a missing folder, a bad import path, ...);
                the sources that did start are closed again.
        """
        results = await asyncio.gather(*(source.start() for source in self._sources.values()), return_exceptions=True)
        problems = [
            f"{name}: {error}" for name, error in zip(self._sources, results, strict=True) if isinstance(error, BaseException)
        ]
        if problems:
            await self.close()
            raise ConfigError("; ".join(problems))

    async def close(self) -> None:
        """Close every source."""
        await asyncio.gather(*(source.close() for source in self._sources.values()), return_exceptions=True)

    def _recipe(self, label: str, index: int) -> tuple[tuple[str, float], ...]:
        recipe = self._recipes.get(label) or self._recipes.get(DEFAULT_RECIPE)
        if recipe is None:
            raise InvalidRequest(
                f"labels[{index}]", f"no reward recipe for label {label!r} and no {DEFAULT_RECIPE!r} recipe "
                f"(recipes: {sorted(self._recipes)})"
            )
        return recipe

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Rewards (N,), metrics and per-item errors for ``items`` (see module docs); ``deadline`` caps remote calls.

        Raises:
            InvalidRequest: an item's label has no recipe and there is no default one.
        """
        n = len(items)
        recipes = [self._recipe(item.label, i) for i, item in enumerate(items)]
        # 1. gather: the items each source is needed for
        needed = {
            name: [i for i, recipe in enumerate(recipes) if any(key == name and w != 0 for key, w in recipe)]
            for name in self._sources
        }
        # 2. process
        running = {name: idx for name, idx in needed.items() if idx}
        answers = await asyncio.gather(
            *(self._timed_score(name, [items[i] for i in idx], deadline) for name, idx in running.items())
        )
        for name, answer in zip(running, answers, strict=True):
            problems = [error for error in answer.errors if error]
            if problems:
                logger.warning("source %s failed on %d of %d items (first: %s)", name, len(problems),
                               len(answer.errors), problems[0])
        per_source = {
            name: apply_fallback(name, answer, self._fallbacks.get(name))
            for name, answer in zip(running, answers, strict=True)
        }
        matrix = np.full((len(self._sources), n), np.nan, np.float32)
        errors: list[list[str]] = [[] for _ in range(n)]
        metrics: dict[str, np.ndarray] = {}
        for row, name in enumerate(self._sources):
            idx = needed[name]
            metrics[f"{name}/reward"] = matrix[row]
            if not idx:
                metrics[f"{name}/failed"] = np.zeros(n, np.float32)
                continue
            answer = per_source[name]
            matrix[row, idx] = answer.rewards
            for metric, values in answer.metrics.items():
                column = np.zeros(n, np.float32) if metric == f"{name}/failed" else np.full(n, np.nan, np.float32)
                column[idx] = values
                metrics[metric] = column
            for i, error in zip(idx, answer.errors, strict=True):
                if error is not None:
                    errors[i].append(error)

        # 3. aggregate
        if self._reward_fn is None:
            weights = np.zeros((len(self._sources), n), np.float32)
            rows = {name: row for row, name in enumerate(self._sources)}
            for i, recipe in enumerate(recipes):
                for name, weight in recipe:
                    weights[rows[name], i] += weight
            # a source with weight 0 may be NaN (not run): count only weighted entries
            rewards = np.where(weights != 0, weights * matrix, 0.0).sum(axis=0).astype(np.float32)
        else:
            rewards, extra = self._call_reward_fn(matrix, items, errors)
            metrics.update(extra)
        failed = [bool(e) for e in errors]
        rewards = np.where(failed, np.float32(np.nan), rewards).astype(np.float32)
        return SourceScores(rewards, metrics, tuple("; ".join(e) if e else None for e in errors))

    async def _timed_score(self, name: str, items: Sequence[ScoreItem], deadline: Deadline) -> SourceScores:
        """``name``'s scores for ``items``, its wall time observed in ``fastexp_reward_source_duration_seconds``."""
        with REWARD_SOURCE_SECONDS.labels(name).time():
            return await self._sources[name].score(items, deadline)

    def _call_reward_fn(
        self, matrix: np.ndarray, items: Sequence[ScoreItem], errors: list[list[str]]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        n = len(items)
        rows = {name: row for row, name in enumerate(self._sources)}
        order = sorted(self._label_map, key=self._label_map.__getitem__)
        model_reward_list = [torch.from_numpy(np.nan_to_num(matrix[rows[name]], nan=0.0)) for name in order]
        try:
            result = self._reward_fn(
                model_reward_list=model_reward_list,
                labels=[item.label for item in items],
                queries=[item.query for item in items],
                refs=[item.reference for item in items],
                label_map=dict(self._label_map),
            )
        except Exception as error:
            logger.warning("reward_fn raised", exc_info=True)
            for e in errors:
                e.append(f"reward_fn raised {type(error).__name__}: {error}")
            return np.full(n, np.nan, np.float32), {}
        rewards, extra = result if isinstance(result, tuple) else (result, {})
        values = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).tolist()
        checked, problems = checked_rewards("reward_fn", values, n)
        for i, problem in enumerate(problems):
            if problem is not None:
                errors[i].append(problem)
        metrics = {}
        for name, value in dict(extra or {}).items():
            column = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
            if column.numel() == 1:
                column = column.expand(n)
            if column.numel() == n:
                metrics[str(name)] = column.numpy().astype(np.float32)
        return checked, metrics


def build_source(config: SourceConfig) -> RewardSource:
    """The runtime source a configuration record describes (not started); networked sources (remote, judge) behind
    their cache when one is enabled (:class:`~services.scorer.outbound.cached_source.CachingSource`)."""
    source = _bare_source(config)
    cache = build_cache(config.cache) if isinstance(config, RemoteConfig | JudgeConfig) else None
    if cache is None:
        return source
    return CachingSource(source, cache, fingerprint(config, config.cache.version))


def _bare_source(config: SourceConfig) -> RewardSource:
    if isinstance(config, LocalModelConfig):
        return LocalModelScorer(
            config.name, config.path, micro_batch_size=config.micro_batch_size, max_length=config.max_length,
            dtype=config.dtype, device=config.device, factory=config.factory, factory_options=config.factory_options,
        )
    if isinstance(config, SimilarityConfig):
        return SimilarityScorer(config.name, config.path, batch_size=config.batch_size, device=config.device)
    if isinstance(config, RemoteConfig):
        return RemoteScorer(config)
    if isinstance(config, RuleConfig):
        return RuleScorer(config.name, config.function, workers=config.workers, timeout_s=config.timeout_s,
                          batched=config.signature == "batch")
    if isinstance(config, JudgeConfig):
        return JudgeScorer(config)
    raise TypeError(f"unknown source config {type(config).__name__}")


def build_composer(settings: ScorerSettings) -> RewardComposer:
    """The composer for ``settings`` (not started: :meth:`RewardComposer.start` loads the sources).

    Raises:
        ConfigError: ``reward_fn`` or a rule's ``function`` does not import (every such name is listed).
    """
    problems = []
    reward_fn = None
    if settings.reward_fn is not None:
        try:
            reward_fn = import_callable(settings.reward_fn)
        except (ImportError, TypeError) as error:
            problems.append(f"reward_fn: {error}")
    for config in settings.sources:
        if isinstance(config, RuleConfig):
            try:
                import_callable(config.function)
            except (ImportError, TypeError) as error:
                problems.append(f"sources.{config.name}.function: {error}")
    if problems:
        raise ConfigError("; ".join(problems))
    recipes = {
        label: [(key, weight) for _, key, weight in entries] for label, entries in settings.recipes.items()
    } or {DEFAULT_RECIPE: [(config.name, 1.0) for config in settings.sources]}
    return RewardComposer(
        [build_source(config) for config in settings.sources],
        {config.name: config.fallback_reward for config in settings.sources},
        recipes,
        reward_fn=reward_fn,
        label_map=settings.reward_fn_label_map or None,
    )

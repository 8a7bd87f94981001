"""Rule-based rewards: Python callables named by import path, run in worker processes with a hard per-item timeout.

A rule function has the signature ``fn(response: str, reference: str) -> float | tuple[float, Mapping[str, float]]``
(one call per item), or the seed's batch signature ``fn(queries, prompts, labels) -> N rewards`` (LightRFT's
``custom_reward_func``, one call per batch), and must be importable (``package.module:function``) in a fresh process. :class:`RuleScorer` runs it in a pebble
process pool: a check that hangs past ``timeout_s`` has its worker killed and replaced, and a check that raises
or returns something that is not a finite number costs that one item (reported as its error), never the
service. Signal-based timeouts would not work off the main thread; killing the worker does.

The built-in rules below are examples reward teams can name directly.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import multiprocessing
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
from pebble import ProcessPool

from services.common.deadlines import Deadline
from services.scorer.scorer import NO_DEADLINE, ScoreItem, SourceScores, checked_rewards

logger = logging.getLogger(__name__)

RuleResult = float | tuple[float, Mapping[str, float]]


def math_verify_reward(response: str, reference: str) -> tuple[float, dict[str, float]]:
    """1.0 when the response's final answer equals the reference answer, else 0.0.

    Both texts are parsed by HF's math-verify (LaTeX and plain expressions; the last answer found in the response
    counts) and compared symbolically with ``math_verify.verify``. An empty reference scores 0.

    Returns:
        ``(reward, {"correct": 0|1, "answer_found": 0|1})``.
    """
    from math_verify import parse, verify

    gold = parse(reference) if reference else []
    predicted = parse(response)
    correct = bool(gold) and bool(predicted) and verify(gold, predicted)
    return float(correct), {"correct": float(correct), "answer_found": float(bool(predicted))}


_BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def boxed_format_reward(response: str, reference: str) -> float:  # noqa: ARG001 - rule signature
    """1.0 when the response states exactly one final answer as ``\\boxed{...}`` (a format check), else 0.0."""
    return float(len(_BOXED.findall(response)) == 1)


def import_callable(path: str) -> Callable[..., object]:
    """Resolve ``'package.module:attr'`` (or ``'package.module.attr'``) to the callable it names.

    Raises:
        ImportError: the module cannot be imported or has no such attribute (the message names ``path``).
        TypeError: the attribute is not callable.
    """
    module_name, _, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"{path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"{path!r}: cannot import {module_name!r} ({error})") from error
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ImportError(f"{path!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{path!r} is not callable")
    return target


@functools.cache
def _resolved(path: str) -> Callable[..., object]:
    return import_callable(path)


def _run_rule(path: str, response: str, reference: str) -> tuple[object, dict[str, float]]:
    """Worker-side: call the rule and split its result into (reward, metrics)."""
    result = _resolved(path)(response, reference)
    if isinstance(result, tuple):
        reward, metrics = result
        return reward, {str(k): float(v) for k, v in dict(metrics).items()}
    return result, {}


def _run_batch_rule(path: str, queries: list[str], prompts: list[str], labels: list[str]) -> np.ndarray:
    """Worker-side: call a batch rule (the seed's ``custom_reward_func``) and check it returned one number per item.

    Raises:
        ValueError: not N numbers.
    """
    result = _resolved(path)(queries, prompts, labels)
    if hasattr(result, "detach"):  # a torch tensor
        result = result.detach().cpu().float().numpy()
    rewards = np.asarray(result, dtype=np.float32).reshape(-1)
    if rewards.shape != (len(queries),):
        raise ValueError(f"returned {rewards.size} rewards for {len(queries)} queries")
    return rewards


class RuleScorer:
    """A :class:`~services.scorer.scorer.RewardSource` running the rule at ``function`` in ``workers`` processes,
    per item, or per batch (``batched``: the seed's ``fn(queries, prompts, labels)``; a timeout, crash or wrong
    count then costs the whole batch)."""

    def __init__(self, name: str, function: str, *, workers: int, timeout_s: float, batched: bool = False) -> None:
        self.name = name
        self._batched = batched
        self._function = function
        self._workers = workers
        self._timeout_s = timeout_s
        self._pool: ProcessPool | None = None

    async def start(self) -> None:
        """Check the import path here, then start the workers and run the rule once in each.

        Raises:
            ImportError, TypeError: ``function`` does not name a callable.
        """
        import_callable(self._function)
        # each worker imports the rule as it starts, a replacement for a killed one too: its import (a rule module
        # may import torch) is not part of any item's timeout_s (under load, 3 s of import timed out every item)
        self._pool = ProcessPool(max_workers=self._workers, context=multiprocessing.get_context("spawn"),
                                 initializer=_resolved, initargs=(self._function,))
        warm_up = [ScoreItem("1", "", "1", "", "1")]
        await asyncio.gather(*(self.score(warm_up) for _ in range(self._workers)))

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Score every item in the pool; a timeout, crash or non-number is that item's error (the batch's, for a
        batch rule)."""
        if self._batched:
            results = await self._score_batch(items)
        else:
            results = await asyncio.gather(*(self._score_one(item) for item in items))
        rewards, errors = checked_rewards(self.name, [reward for reward, *_ in results], len(items))
        errors = [results[i][2] or error for i, error in enumerate(errors)]
        names = sorted({name for _, metrics, *_ in results for name in metrics})
        metrics = {
            name: np.array([m.get(name, np.nan) for _, m, *_ in results], dtype=np.float32) for name in names
        }
        metrics["timeout"] = np.array([timed_out for *_, timed_out in results], dtype=np.float32)
        return SourceScores(rewards, metrics, tuple(errors))

    async def _score_one(self, item: ScoreItem) -> tuple[object, dict[str, float], str | None, bool]:
        """(reward, metrics, error or None, timed out) for one item."""
        assert self._pool is not None, "start() first"
        future = self._pool.schedule(
            _run_rule, args=(self._function, item.response, item.reference), timeout=self._timeout_s
        )
        try:
            reward, metrics = await asyncio.wrap_future(future)
            return reward, metrics, None, False
        except FutureTimeout:
            logger.warning("rule %s timed out after %.1f s on one item", self.name, self._timeout_s)
            return None, {}, f"{self.name}: rule timed out after {self._timeout_s:g} s", True
        except Exception as error:  # a crashing check costs one item
            logger.warning("rule %s failed on one item", self.name, exc_info=True)
            return None, {}, f"{self.name}: rule raised {type(error).__name__}: {error}", False

    async def _score_batch(self, items: Sequence[ScoreItem]) -> list[tuple[object, dict[str, float], str | None, bool]]:
        """Per-item results of one call of a batch rule."""
        assert self._pool is not None, "start() first"
        columns = ([item.query for item in items], [item.prompt for item in items], [item.label for item in items])
        future = self._pool.schedule(_run_batch_rule, args=(self._function, *columns), timeout=self._timeout_s)
        try:
            rewards = await asyncio.wrap_future(future)
            return [(float(reward), {}, None, False) for reward in rewards]
        except FutureTimeout:
            logger.warning("batch rule %s timed out after %.1f s", self.name, self._timeout_s)
            why, timed_out = f"{self.name}: batch rule timed out after {self._timeout_s:g} s", True
        except Exception as error:  # a crashing rule costs its batch, never the service
            logger.warning("batch rule %s failed on a batch of %d", self.name, len(items), exc_info=True)
            why, timed_out = f"{self.name}: batch rule raised {type(error).__name__}: {error}", False
        return [(None, {}, why, timed_out)] * len(items)

    async def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.stop()
            await asyncio.to_thread(self._pool.join, 10)

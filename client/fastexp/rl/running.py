"""Per-run state that outlives a request: running reward moments and the KL coefficient (immutable records).

A training run sends many ``MakeExperiences`` requests with the same ``run_id``; ``reward_running_norm`` and an
adaptive ``kl_coef`` need statistics from all of them. The records here are frozen; every update returns a new
record; the experience service keeps the latest one per run
(:mod:`services.experience.pipeline.statistics`: in the state store, shared by every replica).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

#: A running std below this is treated as "no spread yet": rewards are not scaled (see :meth:`RunningMoments.scale`).
MIN_RUNNING_STD = 1e-6


@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and sum of squared deviations (M2) of every reward seen so far in a run.

    Merged batch by batch with the parallel algorithm of Chan, Golub & LeVeque (1979), as the seed's
    ``RunningMoments`` (adapted there from ROLL), without the seed's ``count = 1e-24`` start, which makes the std
    of a first one-element batch infinite.
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> RunningMoments:
        """Moments of everything seen plus ``values`` (any shape, float). An empty tensor changes nothing."""
        n = values.numel()
        if n == 0:
            return self
        values = values.double()
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        return RunningMoments(
            count=total,
            mean=self.mean + delta * n / total,
            m2=self.m2 + batch_m2 + delta * delta * self.count * n / total,
        )

    @property
    def std(self) -> float:
        """Unbiased (``count - 1``) standard deviation; 1.0 while fewer than two values were seen."""
        if self.count < 2:
            return 1.0
        return math.sqrt(self.m2 / (self.count - 1))

    def scale(self) -> float:
        """The divisor ``reward_running_norm`` uses: :attr:`std`, or 1.0 when it is below ``MIN_RUNNING_STD``.

        A run whose rewards so far are all equal (typical early on, e.g. every answer wrong) has std 0; the seed
        divides by it and produces NaN/inf rewards. Here those rewards are left unscaled instead.
        """
        std = self.std
        return std if std >= MIN_RUNNING_STD else 1.0


@dataclass(frozen=True)
class KLController:
    """The KL coefficient beta of a run: fixed, or adaptive with a target KL.

    Adaptive rule (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593;
    the seed's ``AdaptiveKLController``): after a batch of ``n`` samples with mean per-sequence KL ``kl``,
    ``beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)``.
    """

    value: float
    target: float | None = None
    horizon: int = 10_000

    def update(self, current_kl: float, n_samples: int) -> KLController:
        """The controller after a batch of ``n_samples`` rows whose mean per-sequence KL is ``current_kl`` (nats)."""
        if self.target is None or not math.isfinite(current_kl):
            return self
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        return replace(self, value=self.value * (1.0 + error * n_samples / self.horizon))


@dataclass(frozen=True)
class RunState:
    """What a run carries from batch to batch and request to request."""

    reward_moments: RunningMoments
    kl: KLController


def carried_over(stored: RunState, initial: RunState) -> RunState:
    """The state a run's next batch starts from: ``stored``'s reward moments and beta's value, with the KL target
    and horizon of ``initial`` (the current request's options: a request may change them, never the history)."""
    return replace(stored, kl=replace(initial.kl, value=stored.kl.value))

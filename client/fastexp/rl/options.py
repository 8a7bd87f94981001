"""The options the experience math takes (plain frozen values; the request decoder fills them, trainers may too).

Defaults are OpenRLHF/LightRFT's (``--init_kl_coef 0.01``, ``--kl_horizon 10000``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fastexp.rl.advantages import AdvantageEstimator
from fastexp.rl.rollout_correction import RolloutCorrectionOptions

DEFAULT_KL_COEF = 0.01
DEFAULT_KL_HORIZON = 10_000  # OpenRLHF/LightRFT --kl_horizon


@dataclass(frozen=True)
class KLOptions:
    """KL penalty (``KLSettings``): beta's initial value, estimator, and the adaptive controller's target."""

    kl_coef: float = DEFAULT_KL_COEF
    kl_estimator: str = "k1"
    use_kl_loss: bool = False
    kl_target: float | None = None
    kl_horizon: int = DEFAULT_KL_HORIZON


@dataclass(frozen=True)
class RewardOptions:
    """Scalar-reward processing (``RewardProcessing``); ``overlong_buffer_len = 0`` means no overlong penalty."""

    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = False
    reward_clip: float = 0.0
    overlong_buffer_len: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    max_new_tokens: int = 0


@dataclass(frozen=True)
class AdvantageOptions:
    """Advantage post-processing (``AdvantageProcessing``)."""

    advantages_norm: bool = False
    advantage_clip: float = 0.0


class EstimateConfig(Protocol):
    """What :func:`fastexp.rl.estimate.estimate_experience` reads of a request's configuration.

    The experience service passes its ``ExperienceConfig``; a trainer may pass any object with these attributes
    (a frozen dataclass of its own).
    """

    @property
    def n_samples_per_prompt(self) -> int: ...
    @property
    def estimator(self) -> AdvantageEstimator: ...
    @property
    def kl(self) -> KLOptions: ...
    @property
    def gamma(self) -> float: ...
    @property
    def lambd(self) -> float: ...
    @property
    def reward(self) -> RewardOptions: ...
    @property
    def advantage(self) -> AdvantageOptions: ...
    @property
    def rollout_correction(self) -> RolloutCorrectionOptions | None: ...

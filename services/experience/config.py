"""What one ``MakeExperiences`` request asks of the pipeline, as plain frozen values (no protobuf, no settings).

:mod:`services.experience.api.request` decodes the wire request into an :class:`ExperienceConfig`; the pipeline,
the workers and the experience math (:mod:`fastexp.rl`) read it. Defaults here are the request's documented
defaults; limits on them live with the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastexp.rl.advantages import AdvantageEstimator
from fastexp.rl.options import AdvantageOptions, KLOptions, RewardOptions
from fastexp.rl.rollout_correction import RolloutCorrectionOptions
from fastexp.sampling import SamplingOptions
from services.common.media import EncodedMedia

DEFAULT_MAX_EXTRA_ROUNDS = 3
#: Model turns per episode with an environment when the request does not say.
DEFAULT_MAX_TURNS = 4


@dataclass(frozen=True)
class DynamicSamplingOptions:
    """Dynamic sampling: deliver ``num_groups`` groups with reward variance, refilling at most
    ``max_extra_rounds`` times from the prompts after the first ``num_groups``."""

    num_groups: int
    max_extra_rounds: int = DEFAULT_MAX_EXTRA_ROUNDS


@dataclass(frozen=True)
class EpisodeOptions:
    """Multi-turn episodes: the scorer's ``environment`` by name, at most ``max_turns`` model turns and
    ``max_total_tokens`` response tokens (turns and observations; 0: up to the model's length) per episode."""

    environment: str
    max_turns: int = DEFAULT_MAX_TURNS
    max_total_tokens: int = 0


@dataclass(frozen=True)
class AgentOptions:
    """Agent episodes: each sample is one call of the operator's agent server ``name`` (from the experience
    settings' ``agents`` map, never a URL from the request), whose model calls go through the gateway; at most
    ``max_calls`` calls per episode (None: the agent's own limit)."""

    name: str
    max_calls: int | None = None


@dataclass(frozen=True)
class ExperienceConfig:
    """How rewards become advantages, and what the batch carries (plain values, never a request or settings)."""

    n_samples_per_prompt: int
    estimator: AdvantageEstimator
    micro_rollout_batch_size: int = 0
    kl: KLOptions = KLOptions()
    gamma: float = 1.0
    lambd: float = 1.0
    reward: RewardOptions = RewardOptions()
    advantage: AdvantageOptions = AdvantageOptions()
    dynamic_sampling: DynamicSamplingOptions | None = None
    run_id: str = ""
    return_action_entropy: bool = False
    packing_samples: bool = False
    return_packed: bool = False
    max_staleness: int | None = None  # off-policy bound in policy versions (None: unbounded)
    abort_partial_rollouts: bool = False  # PARTIAL_ROLLOUT_ABORT: resample generations an update interrupts
    normalization_scope: str = "batch"  # "batch" | "rollout": rows advantages_norm / reward_running_norm cover
    skip_actor_forward: bool = False  # action_log_probs are the generator's own (rollout_log_probs)
    episodes: EpisodeOptions | None = None  # multi-turn episodes in an environment (None: single-turn)
    agent: AgentOptions | None = None  # agent episodes through the gateway (exclusive with episodes)
    rollout_correction: RolloutCorrectionOptions | None = None  # truncated IS weights (None: off)

    @property
    def needs_reference(self) -> bool:
        """Whether anything reads the reference's log-probs: a KL penalty in the reward (``kl_coef`` > 0 or an
        adaptive beta) or in the trainer's loss (``use_kl_loss``). Without, no reference forward runs (the seed's
        optional ``initial_model``)."""
        kl = self.kl
        return kl.kl_coef != 0 or kl.kl_target is not None or kl.use_kl_loss

    @property
    def rollout_scope(self) -> bool:
        """Whether batch-wide statistics cover the whole request (nothing streams before the last group)."""
        return self.normalization_scope == "rollout"

    @property
    def groups_per_batch(self) -> int:
        """Whole prompt groups per ExperienceBatch: ``max(1, micro_rollout_batch_size // n)``."""
        return max(1, self.micro_rollout_batch_size // self.n_samples_per_prompt)


@dataclass(frozen=True)
class PromptVision:
    """One multimodal prompt as the processor made it.

    Shape:
        token_ids: P tokens, every placeholder expanded to its patch count;
        pixel_values: (N_i, D) float32, or None without images; image_grid_thw: (I, 3) int64;
        pixel_values_videos: (N_v, D) float32 or None; video_grid_thw: (V, 3) int64.
    """

    token_ids: tuple[int, ...]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor

    @property
    def image_count(self) -> int:
        return self.image_grid_thw.shape[0]

    @property
    def video_count(self) -> int:
        return self.video_grid_thw.shape[0]


@dataclass(frozen=True)
class PromptSpec:
    """One prompt as the policy sees it: rendered text, its token ids, and its supervision.

    A multimodal prompt also keeps its images/videos as sent (``media``, forwarded to the generator and the
    scorer unchanged) and as the processor made them (``vision``: expanded token ids and pixel patches);
    ``token_ids`` are then the *unexpanded* ids (one placeholder per item) that the generator's engine expands.
    """

    text: str
    token_ids: tuple[int, ...]
    reference: str
    label: str
    media: EncodedMedia | None = None
    vision: PromptVision | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of a chat prompt as sent (agents get them)

    @property
    def model_token_ids(self) -> tuple[int, ...]:
        """The prompt as the models see it (placeholders expanded for a multimodal prompt)."""
        return self.vision.token_ids if self.vision is not None else self.token_ids


@dataclass(frozen=True)
class RunBinding:
    """The created run a stream belongs to, as its record (the run registry) says when the stream opens: its
    ``run_id``, ``weight`` in the generator's fair share, backpressure window (``max_groups_ahead`` groups), and
    ``adapter`` (a LoRA run's, named by its run id; None: the base policy)."""

    run_id: str
    weight: float = 1.0
    max_groups_ahead: int | None = None
    adapter: str | None = None


@dataclass(frozen=True)
class StreamPoint:
    """Where a resumable stream (``MakeExperiencesRequest.stream_id``) stands as this open starts.

    ``stream_id`` scoped to ``principal`` (the calling token's) names its record in the state store;
    ``start_version`` is v0 of its first open (``max_staleness`` counts from it); ``first_batch_index`` the
    ``batch_index`` of this open's first batch; ``open_number`` which open this is (1, 2, ...: a later open of the
    stream supersedes it). (Which groups the running statistics counted already is read with
    each batch's statistics: :mod:`services.experience.pipeline.streams`.)"""

    stream_id: str
    principal: str
    start_version: int
    first_batch_index: int = 0
    open_number: int = 1


def run_tenant(run_id: str) -> str:
    """A created run's fair-share tenant (:attr:`ExperienceRequest.tenant`): ``run:<id>``."""
    return f"run:{run_id}"


@dataclass(frozen=True)
class ExperienceRequest:
    """A validated request. ``prompts`` are the ones to sample; the pipeline indexes them 0..len(prompts)-1.
    Some of the message's prompts may be left out (``prompt_overflow = skip``, or groups a resumed stream's client
    holds): ``prompt_indices`` then maps each of ``prompts`` to its index in the message (empty: the identity);
    ``skipped_prompt_indices`` lists those to report dropped with the first batch; ``truncated_prompt_indices``
    are message indices of prompts cut to ``max_prompt_tokens``. ``stream``: a resumable stream's point (None:
    a stream without ``stream_id``); ``run``: the created run it streams (None: none; the request's ``config``
    holds what the request asked, never the run's fields); ``tenant``: whose fair share it draws on, as the API
    keys it (:attr:`share_key`)."""

    request_id: str
    prompts: tuple[PromptSpec, ...]
    sampling: SamplingOptions
    config: ExperienceConfig
    prompt_indices: tuple[int, ...] = ()
    skipped_prompt_indices: tuple[int, ...] = ()
    truncated_prompt_indices: tuple[int, ...] = ()
    stream: StreamPoint | None = None
    run: RunBinding | None = None
    tenant: str = ""

    @property
    def share_key(self) -> str:
        """Whose fair share of the generator and of the scorer's tool sandbox its groups draw on: ``tenant`` as the
        API keys it (``run:...``, ``request:...``), else the request's own (``request:<request_id>``, in process)."""
        return self.tenant or f"request:{self.request_id}"

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter its samples and forwards use (its run's; None: the base policy)."""
        return None if self.run is None else self.run.adapter

    def source_index(self, index: int) -> int:
        """The message's index of ``prompts[index]``."""
        return self.prompt_indices[index] if self.prompt_indices else index

"""The records the experience pipeline's stages pass each other, and what the pipeline calls out to.

The producer (:mod:`~services.experience.pipeline.producer`) turns prompts into scored prompt groups and puts *events* on a
stream's queue: :class:`SampleFinished` (a sample of a group still generating), :class:`ScoredGroup`,
:class:`Dropped` (dynamic sampling), :class:`RoundStarted`,
:class:`GroupsResampled`, :class:`GroupsRerouted`, and finally :class:`Done` or :class:`Failed`. The consumer (:mod:`~services.experience.
pipeline`) folds them into its :class:`~services.experience.pipeline.batcher.Inbox`, has the forwarder
(:mod:`~services.experience.pipeline.forwarder`) turn scored groups into :class:`ForwardedGroup` records, and streams
batches. Every event is immutable; only the consumer counts them into :class:`StreamStats`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastexp.types import ForwardOutputs
from services.common.deadlines import Deadline
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig
from services.common.media import EncodedMedia
from services.common.weights import ReceivedUpdate


@dataclass(frozen=True)
class Scores:
    """``rewards`` (N,) float32 and named (N,) float32 metrics."""

    rewards: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rerouted:
    """In a generation stream: ``groups`` unfinished prompt groups of a failed replica were sent to others (their
    samples so far were dropped; each group still arrives once, whole)."""

    groups: int
    replica: str
    reason: str


@dataclass(frozen=True)
class SamplePreview:
    """In a generation stream: one sample of a group not yet complete on its replica. The group still comes whole
    (with this sample again) unless its replica fails and it is generated again elsewhere (:class:`Rerouted`);
    meanwhile the pipeline may run the sample's forward passes."""

    completion: CompletionRecord


class Generator(Protocol):
    """Where completions come from: the generator fleet (:class:`~services.experience.fleet.generator_fleet.GeneratorFleet`), or
    one generator service through ``GeneratorClient``."""

    def generate(
        self, request: GenerationRequest, deadline: Deadline
    ) -> AsyncIterator[CompletionRecord | Rerouted | SamplePreview]: ...

    async def update_weights(self, update: ReceivedUpdate, deadline: Deadline, version: int | None = None) -> int:
        """Apply a policy update, live as ``version`` (``None``: the previous + 1); return the version now live."""
        ...

    async def load_adapter(
        self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int, deadline: Deadline,
        *, weights_digest: str = "",
    ) -> int:
        """Load a LoRA run's adapter (peft-named tensors), live as ``version``, its blob's ``weights_digest``
        reported by the replicas that hold it; return the version now live."""
        ...

    async def unload_adapter(self, name: str) -> object:
        """Free a deleted LoRA run's adapter wherever it is loaded; never raises for a replica that cannot be told
        (it unloads the copy before it serves again)."""
        ...


@dataclass(frozen=True)
class ScoreBatch:
    """What the scorer is asked for one prompt group (OpenRLHF's reward columns): each ``query`` is its
    ``prompt`` + the response; ``media`` (empty, or one per query) the prompt's images/videos."""

    queries: tuple[str, ...]
    prompts: tuple[str, ...]
    labels: tuple[str, ...]
    references: tuple[str, ...]
    media: tuple[EncodedMedia | None, ...] = ()


@dataclass(frozen=True)
class EpisodeStep:
    """An environment's answer to one model turn: the next ``observation`` (chat ``role``), or ``done`` with the
    episode's ``reward``; ``metrics`` about the episode so far."""

    observation: str | None
    role: str
    reward: float | None
    done: bool
    metrics: dict[str, float]


class Environments(Protocol):
    """Where multi-turn episodes run (the scorer's ``EnvironmentService``, through ``EnvironmentClient``)."""

    async def start(
        self, environment: str, prompt: str, reference: str, label: str, max_turns: int, deadline: Deadline,
        tenant: str = "",
    ) -> tuple[str, str | None, str]: ...

    async def step(self, session_id: str, action: str, deadline: Deadline) -> EpisodeStep: ...

    async def end(self, session_id: str) -> None: ...


@dataclass(frozen=True)
class AgentEpisode:
    """One finished agent episode: its rows (one unless the agent's framework rewrote the conversation: then
    consecutive rows of the same sample), its reward (None: the agent left it to the scorer, which scores the
    ``final_text``) and metrics."""

    rows: tuple[CompletionRecord, ...]
    reward: float | None
    metrics: dict[str, float]
    final_text: str  # the episode's last reply (the scorer's response when the agent gives no reward)


class Agents(Protocol):
    """Where agent episodes run (the gateway's ``AgentRunner``: the operator's agent servers, their model calls
    recorded token-exact)."""

    def check(self, name: str) -> None: ...

    async def run_episode(
        self, name: str, messages: Sequence[Mapping[str, str]], prompt: str, reference: str, label: str,
        prompt_index: int, sample_index: int, deadline: Deadline, max_calls: int | None = None,
    ) -> AgentEpisode: ...


class Scorer(Protocol):
    """Where rewards come from (the scorer service, through ``ScorerClient``)."""

    async def score(self, batch: ScoreBatch, deadline: Deadline) -> Scores: ...


@dataclass
class StreamStats:
    """Counters of one ``make_experiences`` call, complete once the stream ends (trailing metadata). Only the
    consumer writes them, from the events it receives."""

    generation_rounds: int = 0
    dropped_groups: int = 0
    resampled_groups: int = 0
    rerouted_groups: int = 0  # generated again on another generator replica after theirs failed
    failed_groups: list[int] = field(default_factory=list)  # multi-turn groups an episode failure stopped
    undelivered_prompt_indices: list[int] | None = None  # set when the stream failed: what a retry should send


@dataclass(frozen=True)
class ScoredGroup:
    """A prompt group's n completions (sample order) and their scores."""

    completions: tuple[CompletionRecord, ...]
    scores: Scores
    resampled: bool = False  # came back from a resample the consumer asked for

    @property
    def prompt_index(self) -> int:
        return self.completions[0].prompt_index

    @property
    def policy_version(self) -> int:
        """The oldest version among the group's samples."""
        return min(c.policy_version for c in self.completions)


@dataclass(frozen=True)
class SampleFinished:
    """One sample of a group whose other samples are still generating. Its forward passes do not depend on the
    group, so the consumer may run them early, while the engine still decodes (:class:`ScoredGroup` follows)."""

    completion: CompletionRecord


@dataclass(frozen=True)
class Dropped:
    """Dynamic sampling dropped this prompt's group (all its rewards were equal)."""

    prompt_index: int
    resampled: bool = False


@dataclass(frozen=True)
class RoundStarted:
    """A generation round started (dynamic sampling's refills and off-policy admission run several)."""


@dataclass(frozen=True)
class GroupsResampled:
    """``count`` groups an update interrupted (aborting partial rollouts) are being generated again."""

    count: int


@dataclass(frozen=True)
class GroupsRerouted:
    """``count`` groups of a failed generator replica are being generated on another."""

    count: int


@dataclass(frozen=True)
class GroupFailed:
    """A multi-turn group that cannot be completed: one of its episodes failed in its environment (``reason``
    names it). It is not delivered; the stream goes on and lists it in ``failed-prompt-indices``."""

    prompt_index: int
    reason: str
    resampled: bool = False  # it was a resample the consumer asked for (and awaits)


@dataclass(frozen=True)
class Done:
    """Every group was generated once; only resamples the consumer asked for may still come."""


@dataclass(frozen=True)
class Failed:
    """The producer stopped on ``error``; groups received before it are still delivered."""

    error: BaseException


Event = (
    SampleFinished | ScoredGroup | Dropped | RoundStarted | GroupsResampled | GroupsRerouted | GroupFailed | Done
    | Failed
)


@dataclass(frozen=True)
class ForwardedGroup:
    """A scored group with its forward outputs, (n, a) with a = the group's longest response."""

    scored: ScoredGroup
    forward: ForwardOutputs
    actor_version: int  # the actor replica's version when it computed action_log_probs

"""A ``MakeExperiencesRequest`` from Python values: the prompts, and one typed, frozen :class:`RequestOptions`.

Names and meanings follow ``experience.proto``. Where a default differs from the seed's (LightRFT/OpenRLHF
command-line defaults), the field's comment says so.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastexp.sampling import SamplingOptions
from fastexp.v1 import experience_pb2, media_pb2
from fastexp.video import DEFAULT_VIDEO_SAMPLING, VideoSampling, is_video_file, video_frames
from fastexp.wire import sampling_to_pb

#: A prompt: raw text, or chat messages ``[{"role": ..., "content": ...}, ...]`` rendered with the chat template.
PromptLike = str | Sequence[dict[str, str]]
#: An image: its encoded file bytes (PNG/JPEG/...), a path to such a file, or a PIL image (sent as PNG).
ImageLike = bytes | str | os.PathLike | Any
#: A video: a video file (a path, or the file's encoded bytes: mp4, webm, ...; sampled to frames by a
#: :class:`~fastexp.video.VideoSampling`), or its frames in time order, each an ImageLike.
VideoLike = str | os.PathLike | bytes | Sequence[ImageLike]

#: Sampling parameters for a request (see ``fastexp.v1.SamplingParams``): the record checks each field's range;
#: the operator's limits are the services' to check.
Sampling = SamplingOptions
DEFAULT_SAMPLING = Sampling()


@dataclass(frozen=True)
class AgentOptions:
    """Agent episodes (``MakeExperiencesRequest.agent``): each sample is one call of the operator's agent server
    named ``name`` (``agents`` in the experience settings; a request never carries a URL). The agent runs the
    user's agent loop against the service's OpenAI-compatible gateway with a session of its own; every model call
    made with the session is recorded token-exact and becomes the sample's row (split into consecutive rows of one
    sample where the agent's framework rewrote the conversation); the episode's reward is the agent's (a ``null``
    one is the scorer's). The protocol: ``services/experience/gateway/agents.py`` and docs/agents.md.

    ``max_calls``: most model calls per episode, >= 1 (None: no limit but the episode's deadline). The request's
    ``sampling`` does not apply to the agent's calls. Exclusive with ``environment``; an unknown name, dynamic
    sampling and ``partial_rollout="abort"`` are the service's to refuse (INVALID_ARGUMENT naming the field).

    Raises:
        TypeError: ``name`` not a str, ``max_calls`` not an int.
        InvalidOption: (a ValueError) an empty ``name`` (``agent.name``) or ``max_calls`` out of range
            (``agent.max_calls``).
    """

    name: str
    max_calls: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"AgentOptions.name: {type(self.name).__name__}, expected str")
        if self.max_calls is not None and (not isinstance(self.max_calls, int) or isinstance(self.max_calls, bool)):
            raise TypeError(f"AgentOptions.max_calls: {type(self.max_calls).__name__}, expected int | None")
        if not self.name:
            raise InvalidOption("agent.name", "name one of the operator's agents")
        if self.max_calls is not None:
            _Bound(1, _UINT32).check("agent.max_calls", self.max_calls)


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """Everything about a request but its prompts (and their references, labels, images and videos).

    Built once and checked here, before anything is sent: types, the values of enumerations, and the ranges a
    field's meaning gives it (:data:`_BOUNDS`: γ ∈ [0, 1], n ≥ 1, clips ≥ 0, ...). What depends on the service
    (limits the operator sets, estimators that need a critic, combinations) is the service's to check, and comes
    back as INVALID_ARGUMENT naming the field.

    ``None`` means unset: the field stays unset on the wire and the service's default applies (the defaults live
    there alone; each field's comment says what it is today).

    Raises:
        TypeError: a field of the wrong type (``n_samples_per_prompt="4"``), naming every such field.
        InvalidOption: (a ValueError) a field outside its values or range; ``field`` names it.
    """

    n_samples_per_prompt: int  # samples per prompt: the group a baseline is taken over (seed default: 1)
    sampling: SamplingOptions = DEFAULT_SAMPLING  # its max_new_tokens default: the service's
    # (default_max_new_tokens, 256 unless the operator changes it; seed: generate_max_len 1024)
    micro_rollout_batch_size: int = 0  # rows per ExperienceBatch, whole groups (0: one group per batch)
    advantage_estimator: str | None = None  # group_norm, rloo, reinforce, ..., gae (default: the service's
    # (group_norm); the seed's: gae)
    kl_coef: float | None = None  # beta of the KL penalty in the reward (None: the service's 0.01, the seed's)
    kl_estimator: str | None = None  # k1, k2 or k3, Schulman's estimators (default: the service's (k1))
    use_kl_loss: bool = False  # the trainer adds KL to its loss: no KL in the reward (GRPO)
    kl_target: float | None = None  # set: adaptive beta towards this KL (Ziegler et al. 2019)
    kl_horizon: int | None = None  # adaptive beta's horizon (None: the service's 10000, the seed's)
    gamma: float | None = None  # discount (None: the service's 1.0)
    lambd: float | None = None  # GAE lambda (None: the service's 1.0; seed default: 0.95)
    reward_running_norm: bool = False  # divide rewards by their running std over the run (run_id)
    reward_running_norm_minus_mean: bool = False  # and subtract the running mean
    reward_clip: float = 0.0  # clip rewards to [-c, c] (0: off)
    overlong_buffer_len: int = 0  # DAPO's overlong penalty buffer, tokens (0: off)
    overlong_buffer_penalty_factor: float | None = None  # the penalty at max_new_tokens (None: the service's 1.0)
    advantages_norm: bool = False  # whiten advantages over action_mask
    advantage_clip: float = 0.0  # clip advantages to [-c, c] (0: off)
    dynamic_sampling_num_groups: int = 0  # DAPO's dynamic sampling: deliver this many groups with variance (0: off)
    dynamic_sampling_max_extra_rounds: int | None = None  # refill rounds for the shortfall (None: the service's 3)
    run_id: str = ""  # running reward statistics and adaptive beta persist across requests with one run_id
    return_action_entropy: bool = False  # also stream the actor's per-token entropy
    packing_samples: bool = False  # packed forwards (each group's prompt computed once)
    return_packed: bool = False  # stream the packed layout (1, T) instead of padded (B, S)
    max_staleness: int | None = None  # off-policy bound in policy versions (None: unbounded)
    partial_rollout: Literal["finish", "abort"] = "finish"  # generations in flight across a policy update
    normalization_scope: Literal["batch", "rollout"] = "batch"  # what advantages_norm / running norm cover
    skip_actor_forward: bool = False  # action_log_probs = the generator's (rollout_log_probs): no actor forward
    environment: str = ""  # multi-turn: each sample an episode in the scorer's environment of this name
    max_turns: int = 0  # model turns per episode (0: the service's default, 4)
    max_total_tokens: int = 0  # response tokens per episode, turns and observations (0: the model's length)
    prompt_overflow: Literal["reject", "truncate_left", "skip"] = "reject"  # prompts over max_prompt_tokens (seed:
    # truncates to prompt_max_len)
    max_prompt_tokens: int = 0  # the seed's prompt_max_len (0: the model's length minus one)
    rollout_is: Literal["off", "token", "sequence"] = "off"  # truncated importance weights (rollout_is_weights)
    rollout_is_threshold: float | None = None  # their truncation C >= 1 (None: the service's default, 2.0)
    agent: AgentOptions | None = None  # each sample one call of the operator's agent server (None: no agent)
    request_id: str = ""  # names the stream in the services' logs (else the x-request-id metadata, else new)
    stream_id: str = ""  # the resumable stream's id (""; the client makes one: fastexp.resume)

    def __post_init__(self) -> None:
        hints = _hints()
        wrong = [
            f"{field.name}: {type(getattr(self, field.name)).__name__}, expected {hints[field.name]}"
            for field in dataclasses.fields(self)
            if not _is_instance(getattr(self, field.name), hints[field.name])
        ]
        if wrong:
            raise TypeError("RequestOptions: " + "; ".join(wrong))
        for name in ("partial_rollout", "normalization_scope", "prompt_overflow", "rollout_is"):
            allowed = typing.get_args(hints[name])
            if getattr(self, name) not in allowed:
                raise InvalidOption(name, f"{getattr(self, name)!r} is not one of {allowed}")
        for name, bound in _BOUNDS.items():
            if getattr(self, name) is not None:
                bound.check(name, getattr(self, name))


class InvalidOption(ValueError):
    """A :class:`RequestOptions` field outside its values or range; ``field`` names it, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"RequestOptions.{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class _Bound:
    """``low <= value <= high`` (``low < value`` when ``low_open``); floats finite."""

    low: float
    high: float = math.inf
    low_open: bool = False

    def check(self, field: str, value: float) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidOption(field, f"must be finite, got {value}")
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            low = f"({self.low}" if self.low_open else f"[{self.low}"
            raise InvalidOption(field, f"must be in {low}, {self.high}], got {value}")


_UINT32 = 2**32 - 1  # the wire's uint32 fields
_COUNT = _Bound(0, _UINT32)
_NON_NEGATIVE = _Bound(0.0)
#: field -> the range its meaning gives it (limits the operator sets are the service's). A new numeric option
#: adds its line here.
_BOUNDS: dict[str, _Bound] = {
    "n_samples_per_prompt": _Bound(1, _UINT32), "micro_rollout_batch_size": _COUNT,
    "kl_coef": _NON_NEGATIVE, "kl_target": _Bound(0.0, low_open=True), "kl_horizon": _Bound(1, _UINT32),
    "gamma": _Bound(0.0, 1.0), "lambd": _Bound(0.0, 1.0),
    "reward_clip": _NON_NEGATIVE, "overlong_buffer_len": _COUNT, "overlong_buffer_penalty_factor": _NON_NEGATIVE,
    "advantage_clip": _NON_NEGATIVE, "dynamic_sampling_num_groups": _COUNT,
    "dynamic_sampling_max_extra_rounds": _COUNT, "max_staleness": _COUNT, "max_turns": _COUNT,
    "max_total_tokens": _COUNT, "max_prompt_tokens": _COUNT, "rollout_is_threshold": _Bound(1.0),
}


@functools.cache
def _hints() -> dict[str, Any]:
    """RequestOptions' field types, resolved once."""
    return typing.get_type_hints(RequestOptions)


def _is_instance(value: object, hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return isinstance(value, str)  # the values are checked separately, with a clearer message
    if origin in (types.UnionType, typing.Union):
        return any(_is_instance(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)  # type: ignore[arg-type]


def encode_image(image: ImageLike) -> bytes:
    """The encoded bytes sent for ``image``: bytes as given, a file's contents, or a PIL image saved as PNG.

    Raises:
        OSError: a path that cannot be read. TypeError: anything else.
    """
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        with open(image, "rb") as file:
            return file.read()
    if hasattr(image, "save"):  # PIL.Image.Image (Pillow is a dependency of the services, not of every trainer)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"an image is bytes, a path or a PIL image, not {type(image).__name__}")


def build_request(
    prompts: Sequence[PromptLike],
    options: RequestOptions | None = None,
    *,
    references: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    images: Sequence[Sequence[ImageLike]] | None = None,
    videos: Sequence[Sequence[VideoLike]] | None = None,
    video_sampling: VideoSampling = DEFAULT_VIDEO_SAMPLING,
    **overrides: Any,
) -> experience_pb2.MakeExperiencesRequest:
    """A ``MakeExperiencesRequest`` for ``prompts`` with ``options``; keyword ``overrides`` replace options'
    fields (``build_request(prompts, n_samples_per_prompt=4, gamma=0.99)`` builds the options from them alone).

    ``references``/``labels`` give each prompt its reference answer and label; ``images``/``videos`` its images
    and videos (one list per prompt, empty for text-only ones; see ``PromptInput`` for where they go). A video
    given as a file (path or encoded bytes) is decoded here and sampled to frames by ``video_sampling``
    (:mod:`fastexp.video`: ``fps`` frames per second, at most ``max_frames``, evenly spaced).

    Raises:
        ValueError: a column given with a length other than ``len(prompts)``; an option value (RequestOptions); a
            video file that cannot be decoded.
        TypeError: an unknown or mistyped option. OSError: an image or video path that cannot be read.
        ImportError: a video file without the ``video`` extra (PyAV, Pillow).
    """
    options = dataclasses.replace(options, **overrides) if options is not None else RequestOptions(**overrides)
    for name, column in (("references", references), ("labels", labels), ("images", images), ("videos", videos)):
        if column is not None and len(column) != len(prompts):
            raise ValueError(f"{len(column)} {name} for {len(prompts)} prompts")
    inputs = [
        _prompt_input(prompt, *(None if column is None else column[i] for column in (references, labels, images, videos)),
                      video_sampling)
        for i, prompt in enumerate(prompts)
    ]
    return experience_pb2.MakeExperiencesRequest(prompts=inputs, **_message_fields(options))


def _prompt_input(prompt: PromptLike, reference, label, images, videos, video_sampling) -> experience_pb2.PromptInput:
    item = experience_pb2.PromptInput()
    if isinstance(prompt, str):
        item.text = prompt
    else:
        item.chat.messages.extend(experience_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    if reference is not None:
        item.reference = reference
    if label is not None:
        item.label = label
    item.images.extend(media_pb2.Image(data=encode_image(image)) for image in images or ())
    item.videos.extend(
        media_pb2.Video(frames=video_frames(video, video_sampling) if is_video_file(video)
                        else [encode_image(frame) for frame in video])
        for video in videos or ()
    )
    return item


def _message_fields(o: RequestOptions) -> dict[str, Any]:
    """``MakeExperiencesRequest`` fields (all but prompts) of ``o``."""
    return dict(
        request_id=o.request_id, stream_id=o.stream_id, sampling=sampling_to_pb(o.sampling), n_samples_per_prompt=o.n_samples_per_prompt,
        micro_rollout_batch_size=o.micro_rollout_batch_size, advantage_estimator=o.advantage_estimator,
        kl=experience_pb2.KLSettings(
            kl_coef=o.kl_coef, kl_estimator=o.kl_estimator, use_kl_loss=o.use_kl_loss, kl_target=o.kl_target,
            kl_horizon=o.kl_horizon,
        ),
        gamma=o.gamma, lambd=o.lambd,
        reward_processing=experience_pb2.RewardProcessing(
            reward_running_norm=o.reward_running_norm, reward_running_norm_minus_mean=o.reward_running_norm_minus_mean,
            reward_clip=o.reward_clip, overlong_buffer=o.overlong_buffer_len > 0,
            overlong_buffer_len=o.overlong_buffer_len, overlong_buffer_penalty_factor=o.overlong_buffer_penalty_factor,
        ),
        advantage_processing=experience_pb2.AdvantageProcessing(
            advantages_norm=o.advantages_norm, advantage_clip=o.advantage_clip
        ),
        dynamic_sampling=experience_pb2.DynamicSampling(
            enabled=o.dynamic_sampling_num_groups > 0, num_groups=o.dynamic_sampling_num_groups,
            max_extra_rounds=o.dynamic_sampling_max_extra_rounds,
        ),
        run_id=o.run_id, return_action_entropy=o.return_action_entropy, packing_samples=o.packing_samples,
        return_packed=o.return_packed, max_staleness=o.max_staleness, skip_actor_forward=o.skip_actor_forward,
        environment=o.environment, max_turns=o.max_turns, max_total_tokens=o.max_total_tokens,
        partial_rollout=experience_pb2.PartialRollout.Value(f"PARTIAL_ROLLOUT_{o.partial_rollout.upper()}"),
        normalization_scope=experience_pb2.NormalizationScope.Value(
            f"NORMALIZATION_SCOPE_{o.normalization_scope.upper()}"
        ),
        prompt_overflow=experience_pb2.PromptOverflow.Value(f"PROMPT_OVERFLOW_{o.prompt_overflow.upper()}"),
        max_prompt_tokens=o.max_prompt_tokens,
        rollout_correction=experience_pb2.RolloutCorrection(
            level=experience_pb2.RolloutCorrectionLevel.Value(f"ROLLOUT_CORRECTION_{o.rollout_is.upper()}"),
            threshold=o.rollout_is_threshold,
        ),
        agent=None if o.agent is None else experience_pb2.AgentOptions(  # max_calls None: 0 on the wire, no limit
            name=o.agent.name, max_calls=o.agent.max_calls or 0),
    )

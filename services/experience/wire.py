"""Experience <-> ``fastexp.v1.ExperienceBatch`` (used by the servicer to encode and the SDK to decode)."""

from __future__ import annotations

import torch

from fastexp.v1 import experience_pb2
from services.common.tensor_codec import to_torch, write_torch
from services.experience.types import Experience
from services.experience.vision import VisionInputs

_TENSORS = (
    "sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "returns",
    "advantages", "kl", "reward", "response_length", "total_length", "rollout_log_probs", "shaped_reward",
)
_OPTIONAL_TENSORS = ("values", "action_entropy", "packed_seq_lens")
_SCALARS = (
    "kl_coef", "batch_index", "reward_clip_frac", "advantage_clip_frac", "reward_norm_mean", "reward_norm_std",
    "actor_policy_version", "resampled_groups", "repaired_vision_tokens",
)


def experience_to_pb(experience: Experience) -> experience_pb2.ExperienceBatch:
    """Encode an Experience; tensors keep their dtypes (int64 ids and lengths, bool mask, float32 values)."""
    message = experience_pb2.ExperienceBatch(
        prompt_index=experience.prompt_index,
        sample_index=experience.sample_index,
        prompt_texts=experience.prompt_texts,
        response_texts=experience.response_texts,
        policy_version=experience.policy_version,
        dropped_prompt_indices=experience.dropped_prompt_indices,
        **{name: getattr(experience, name) for name in _SCALARS},
    )
    for name in _TENSORS:
        write_torch(getattr(experience, name), getattr(message, name))
    for name in _OPTIONAL_TENSORS:
        if getattr(experience, name) is not None:
            write_torch(getattr(experience, name), getattr(message, name))
    for name, values in experience.reward_metrics.items():
        write_torch(values, message.reward_metrics[name])
    if experience.vision is not None:
        _vision_to_pb(experience.vision, message)
    return message


def _vision_to_pb(vision: VisionInputs, message: experience_pb2.ExperienceBatch) -> None:
    message.image_count.extend(vision.image_count)
    message.video_count.extend(vision.video_count)
    write_torch(vision.image_grid_thw, message.image_grid_thw)
    write_torch(vision.video_grid_thw, message.video_grid_thw)
    if vision.pixel_values is not None:
        write_torch(vision.pixel_values, message.pixel_values)
    if vision.pixel_values_videos is not None:
        write_torch(vision.pixel_values_videos, message.pixel_values_videos)


def _vision_from_pb(message: experience_pb2.ExperienceBatch) -> VisionInputs | None:
    if not message.image_count and not message.video_count:
        return None
    return VisionInputs(
        pixel_values=to_torch(message.pixel_values) if message.HasField("pixel_values") else None,
        image_grid_thw=to_torch(message.image_grid_thw),
        image_count=tuple(message.image_count),
        pixel_values_videos=to_torch(message.pixel_values_videos) if message.HasField("pixel_values_videos") else None,
        video_grid_thw=to_torch(message.video_grid_thw),
        video_count=tuple(message.video_count),
    )


def experience_from_pb(message: experience_pb2.ExperienceBatch) -> Experience:
    """Decode an ExperienceBatch into CPU torch tensors.

    Raises:
        services.common.tensor_codec.TensorDecodeError: a tensor is malformed.
    """
    tensors: dict[str, torch.Tensor | None] = {name: to_torch(getattr(message, name)) for name in _TENSORS}
    for name in _OPTIONAL_TENSORS:
        tensors[name] = to_torch(getattr(message, name)) if message.HasField(name) else None
    return Experience(
        **tensors,
        prompt_index=tuple(message.prompt_index),
        sample_index=tuple(message.sample_index),
        prompt_texts=tuple(message.prompt_texts),
        response_texts=tuple(message.response_texts),
        policy_version=tuple(message.policy_version),
        reward_metrics={name: to_torch(t) for name, t in message.reward_metrics.items()},
        dropped_prompt_indices=tuple(message.dropped_prompt_indices),
        vision=_vision_from_pb(message),
        **{name: getattr(message, name) for name in _SCALARS},
    )

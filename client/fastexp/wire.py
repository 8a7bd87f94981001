"""Experience <-> ``fastexp.v1.ExperienceBatch`` (used by the servicer to encode and the SDK to decode)."""

from __future__ import annotations

import dataclasses

import torch

from fastexp.layout import EXPERIENCE_LAYOUT, Kind, fields_of
from fastexp.sampling import SamplingOptions
from fastexp.tensor_codec import to_torch, write_torch
from fastexp.types import Experience, VisionInputs
from fastexp.v1 import experience_pb2, generation_pb2

# Each Experience field travels in the ExperienceBatch field of the same name (fastexp.layout).
_TENSORS = tuple(name for name, layout in EXPERIENCE_LAYOUT.items() if layout.tensor and not layout.optional)
_OPTIONAL_TENSORS = tuple(name for name, layout in EXPERIENCE_LAYOUT.items() if layout.tensor and layout.optional)
_SCALARS = fields_of(Kind.SCALAR)
_REPEATED = fields_of(Kind.ROW, tensor=False) + fields_of(Kind.BATCH)  # tuples of ints or strings


def experience_to_pb(experience: Experience) -> experience_pb2.ExperienceBatch:
    """Encode an Experience; tensors keep their dtypes (int64 ids and lengths, bool mask, float32 values)."""
    message = experience_pb2.ExperienceBatch(**{name: getattr(experience, name) for name in _SCALARS + _REPEATED})
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
        fastexp.tensor_codec.TensorDecodeError: a tensor is malformed.
    """
    tensors: dict[str, torch.Tensor | None] = {name: to_torch(getattr(message, name)) for name in _TENSORS}
    for name in _OPTIONAL_TENSORS:
        tensors[name] = to_torch(getattr(message, name)) if message.HasField(name) else None
    return Experience(
        **tensors,
        **{name: tuple(getattr(message, name)) for name in _REPEATED},
        **{name: getattr(message, name) for name in _SCALARS},
        reward_metrics={name: to_torch(t) for name, t in message.reward_metrics.items()},
        vision=_vision_from_pb(message),
    )


def sampling_to_pb(options: SamplingOptions) -> generation_pb2.SamplingParams:
    """``options`` as a ``SamplingParams`` message (its fields have these names; unset ones stay unset)."""
    fields = dataclasses.asdict(options)
    return generation_pb2.SamplingParams(**{name: value for name, value in fields.items() if value is not None})

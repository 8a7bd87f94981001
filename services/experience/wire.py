"""Experience <-> ``fastexp.v1.ExperienceBatch`` (used by the servicer to encode and the SDK to decode)."""

from __future__ import annotations

import torch

from fastexp.v1 import experience_pb2
from services.common.tensor_codec import from_torch, to_torch
from services.experience.types import Experience

_TENSORS = (
    "sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "returns",
    "advantages", "kl", "reward", "response_length", "total_length", "rollout_log_probs",
)


def experience_to_pb(experience: Experience) -> experience_pb2.ExperienceBatch:
    """Encode an Experience; tensors keep their dtypes (int64 ids and lengths, bool mask, float32 values)."""
    message = experience_pb2.ExperienceBatch(
        prompt_index=experience.prompt_index,
        sample_index=experience.sample_index,
        prompt_texts=experience.prompt_texts,
        response_texts=experience.response_texts,
        policy_version=experience.policy_version,
        kl_coef=experience.kl_coef,
        batch_index=experience.batch_index,
    )
    for name in _TENSORS:
        getattr(message, name).CopyFrom(from_torch(getattr(experience, name)))
    if experience.values is not None:
        message.values.CopyFrom(from_torch(experience.values))
    for name, values in experience.reward_metrics.items():
        message.reward_metrics[name].CopyFrom(from_torch(values))
    return message


def experience_from_pb(message: experience_pb2.ExperienceBatch) -> Experience:
    """Decode an ExperienceBatch into CPU torch tensors.

    Raises:
        services.common.tensor_codec.TensorDecodeError: a tensor is malformed.
    """
    tensors: dict[str, torch.Tensor] = {name: to_torch(getattr(message, name)) for name in _TENSORS}
    return Experience(
        **tensors,
        values=to_torch(message.values) if message.HasField("values") else None,
        prompt_index=tuple(message.prompt_index),
        sample_index=tuple(message.sample_index),
        prompt_texts=tuple(message.prompt_texts),
        response_texts=tuple(message.response_texts),
        policy_version=tuple(message.policy_version),
        reward_metrics={name: to_torch(t) for name, t in message.reward_metrics.items()},
        kl_coef=message.kl_coef,
        batch_index=message.batch_index,
    )

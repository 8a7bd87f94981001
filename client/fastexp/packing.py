"""The packed ExperienceBatch layout and back (pure).

Packed (OpenRLHF's ``packing_samples`` convention): ``sequences``/``attention_mask`` (1, T), T = sum of
``total_length``, rows concatenated without padding and ``attention_mask`` = row index + 1 on each row's tokens;
``packed_seq_lens`` (B,) = ``total_length``; every per-action tensor (1, N), N = sum of ``response_length``, the
rows' response tokens in row order; ``action_mask`` (1, N) true on the model's sampled tokens (all true but for
the observation tokens of multi-turn episodes). Per-row tensors (reward, lengths) keep (B,).
"""

from __future__ import annotations

import torch

from fastexp.layout import ACTION_FIELDS
from fastexp.types import Experience


def pack_experience(experience: Experience) -> Experience:
    """The padded ``experience`` in the packed layout. An already packed one is returned as is."""
    if experience.packed_seq_lens is not None:
        return experience
    keep = experience.attention_mask.bool()
    row_ids = torch.arange(1, keep.shape[0] + 1, dtype=torch.int64).unsqueeze(1).expand_as(keep)
    num_actions = experience.action_mask.shape[1]
    mask = torch.arange(num_actions).unsqueeze(0) < experience.response_length.unsqueeze(1)  # response positions
    packed = {
        name: None if getattr(experience, name) is None else getattr(experience, name)[mask].unsqueeze(0)
        for name in ACTION_FIELDS
    }
    return experience._replace(
        sequences=experience.sequences[keep].unsqueeze(0),
        attention_mask=row_ids[keep].unsqueeze(0),
        packed_seq_lens=experience.total_length.clone(),
        **packed,
    )


def unpack_experience(experience: Experience, pad_token_id: int) -> Experience:
    """A packed ``experience`` back in the padded layout (prompts left-padded with ``pad_token_id``, responses
    right-padded with it, per-action tensors 0 on padding). A padded one is returned as is.

    Raises:
        ValueError: lengths that do not add up to the packed tensors' sizes.
    """
    if experience.packed_seq_lens is None:
        return experience
    total = experience.packed_seq_lens
    responses = experience.response_length
    if int(total.sum()) != experience.sequences.shape[1] or int(responses.sum()) != experience.action_mask.shape[1]:
        raise ValueError("packed_seq_lens/response_length do not match the packed tensors")
    prompts = total - responses
    batch = total.shape[0]
    num_actions = max(1, int(responses.max())) if batch else 1
    prompt_width = int(prompts.max()) if batch else 0
    sequences = torch.full((batch, prompt_width + num_actions), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros_like(sequences)
    positions = torch.arange(num_actions).unsqueeze(0) < responses.unsqueeze(1)
    tokens = experience.sequences[0].split(total.tolist())
    for row, piece in enumerate(tokens):
        p, t = int(prompts[row]), int(responses[row])
        sequences[row, prompt_width - p : prompt_width + t] = piece
        attention_mask[row, prompt_width - p : prompt_width + t] = 1
    unpacked: dict[str, torch.Tensor | None] = {}
    for name in ACTION_FIELDS:
        value = getattr(experience, name)
        if value is None:
            continue
        padded = torch.zeros((batch, num_actions), dtype=value.dtype)
        padded[positions] = value[0]
        unpacked[name] = padded
    return experience._replace(sequences=sequences, attention_mask=attention_mask, packed_seq_lens=None, **unpacked)

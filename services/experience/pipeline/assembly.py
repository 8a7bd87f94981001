"""Per-group pieces into ExperienceBatches and back (pure).

The pipeline runs forward passes on whatever prompt groups are ready, so a batch's forward outputs arrive as
per-group pieces, each padded only to its own group's response length ``a``; :func:`concat_forward` re-pads them
to the batch's A. With ``normalization_scope = ROLLOUT`` the experience of the whole request is estimated at once
and :func:`split_experience` cuts it into batches, trimming the padding each batch does not need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastexp.layout import EXPERIENCE_LAYOUT, FIRST_BATCH_ONLY, Kind
from fastexp.types import Experience, ForwardOutputs


def pad_actions(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad (rows, a) to (rows, ``width``) with zeros (``width >= a``)."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))


def concat_forward(parts: Sequence[ForwardOutputs], width: int) -> ForwardOutputs:
    """Stack per-group forward outputs (rows_g, a_g) into (sum rows_g, ``width``), zero on the added padding.

    ``values``/``action_entropy`` must be present in every part or in none.
    """

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(part, name) for part in parts]
        if all(t is None for t in tensors):
            return None
        return torch.cat([pad_actions(t, width) for t in tensors])

    return ForwardOutputs(*(cat(name) for name in ForwardOutputs._fields))


def split_forward(forward: ForwardOutputs, rows: Sequence[int], widths: Sequence[int]) -> list[ForwardOutputs]:
    """Cut (B, A) forward outputs into consecutive pieces of ``rows[i]`` rows, each trimmed to ``widths[i]``."""
    pieces, start = [], 0
    for count, width in zip(rows, widths, strict=True):
        pieces.append(ForwardOutputs(*(
            None if t is None else t[start : start + count, :width].contiguous() for t in forward
        )))
        start += count
    if start != forward.action_log_probs.shape[0]:
        raise ValueError(f"pieces cover {start} rows of {forward.action_log_probs.shape[0]}")
    return pieces


def group_batches(prompt_index: Sequence[int], groups_per_batch: int) -> list[slice]:
    """Consecutive row slices of ``groups_per_batch`` whole prompt groups each (the last may hold fewer); a group
    is a run of rows with one prompt index (n rows, more where agent episodes were split).

    Raises:
        ValueError: ``groups_per_batch < 1``.
    """
    if groups_per_batch < 1:
        raise ValueError(f"groups_per_batch must be >= 1, got {groups_per_batch}")
    starts = [row for row in range(len(prompt_index)) if row == 0 or prompt_index[row] != prompt_index[row - 1]]
    cuts = [*starts[::groups_per_batch], len(prompt_index)]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def split_experience(experience: Experience, groups_per_batch: int) -> list[Experience]:
    """Cut a padded Experience into consecutive batches of ``groups_per_batch`` whole prompt groups (the last may
    hold fewer; :func:`group_batches`).

    Each batch keeps the fields of the whole (scalars, ``kl_coef``, clip fractions, the normalization statistics)
    and gets ``batch_index`` = its position after the first's; ``dropped_prompt_indices`` and
    ``resampled_groups`` go with the first batch only. Each batch's (B, S) and (B, A) tensors are trimmed to the
    widest prompt and response among its own rows (A >= 1), so it is laid out as if it had been built alone.

    Raises:
        ValueError: ``experience`` is in the packed layout, or ``groups_per_batch < 1``.
    """
    if experience.packed_seq_lens is not None:
        raise ValueError("split_experience takes the padded layout")
    prompt_width = experience.sequences.shape[1] - experience.action_mask.shape[1]
    batches = []
    for number, rows in enumerate(group_batches(experience.prompt_index, groups_per_batch)):
        response_length = experience.response_length[rows]
        num_actions = max(1, int(response_length.max()))
        left = prompt_width - int((experience.total_length[rows] - response_length).max())
        fields = {}
        for name, value in zip(Experience._fields, experience, strict=True):
            kind = EXPERIENCE_LAYOUT[name].kind
            if value is None or kind in (Kind.SCALAR, Kind.BATCH):
                pass
            elif kind is Kind.SEQUENCE:
                value = value[rows, left : prompt_width + num_actions]
            elif kind is Kind.ACTION:
                value = value[rows, :num_actions]
            elif kind is Kind.METRICS:
                value = {key: metric[rows] for key, metric in value.items()}
            elif kind is Kind.ROW:
                value = value[rows]
            elif kind is Kind.VISION:
                value = value.select(rows)
            fields[name] = value
        fields["batch_index"] = experience.batch_index + number
        if number:
            fields.update(FIRST_BATCH_ONLY)  # counts since the previous batch go with the first one
        batches.append(Experience(**fields))
    return batches

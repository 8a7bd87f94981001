"""The one table of :class:`~fastexp.types.Experience`'s fields: what each is indexed by, and its dtype.

Batching (:mod:`~services.experience.pipeline.assembly`), packing (:mod:`~fastexp.packing`), the wire codec
(:mod:`~fastexp.wire`) and the estimate (:mod:`~fastexp.rl.estimate`) read this table instead
of naming fields, so a new Experience field is one entry here (plus the field itself and its proto field of the
same name). Importing this module checks that the table and the record list the same fields.

Kinds (B rows, A padded response length, S padded sequence length):

- ``sequence``: (B, S) tensor, prompts left-padded, responses right-padded.
- ``action``: (B, A) tensor over response tokens, 0 on padding (float) or False (the mask).
- ``row``: one value per row: a (B,) tensor, or a tuple of B Python values (``dtype`` None).
- ``metrics``: name -> (B,) float32 tensor (``reward_metrics``).
- ``scalar``: one Python number for the whole batch.
- ``batch``: a tuple for the whole batch (not per row), e.g. the prompt indices dropped since the last batch.
- ``vision``: the rows' pixel patches and grids (:class:`~fastexp.types.VisionInputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

import torch

from fastexp.types import Experience


class Kind(StrEnum):
    SEQUENCE = "sequence"
    ACTION = "action"
    ROW = "row"
    METRICS = "metrics"
    SCALAR = "scalar"
    BATCH = "batch"
    VISION = "vision"


@dataclass(frozen=True)
class FieldLayout:
    """One Experience field.

    ``dtype``: a tensor field's torch dtype (``None``: not a tensor); ``optional``: may be ``None`` (no critic,
    no entropy requested, the padded layout); ``first_batch_only``: a count or list "since the previous batch",
    carried by the first of several batches cut from one estimate (the others get the field's default).
    """

    kind: Kind
    dtype: torch.dtype | None = None
    optional: bool = False
    first_batch_only: bool = False

    @property
    def tensor(self) -> bool:
        """Whether the field is a tensor (sent as ``fastexp.v1.Tensor``), not Python values."""
        return self.dtype is not None


_F32, _I64 = torch.float32, torch.int64

EXPERIENCE_LAYOUT: Mapping[str, FieldLayout] = MappingProxyType({
    "sequences": FieldLayout(Kind.SEQUENCE, _I64),
    "attention_mask": FieldLayout(Kind.SEQUENCE, _I64),
    "action_mask": FieldLayout(Kind.ACTION, torch.bool),
    "action_log_probs": FieldLayout(Kind.ACTION, _F32),
    "base_action_log_probs": FieldLayout(Kind.ACTION, _F32, optional=True),
    "values": FieldLayout(Kind.ACTION, _F32, optional=True),
    "returns": FieldLayout(Kind.ACTION, _F32),
    "advantages": FieldLayout(Kind.ACTION, _F32),
    "kl": FieldLayout(Kind.ACTION, _F32, optional=True),
    "reward": FieldLayout(Kind.ROW, _F32),
    "response_length": FieldLayout(Kind.ROW, _I64),
    "total_length": FieldLayout(Kind.ROW, _I64),
    "prompt_index": FieldLayout(Kind.ROW),
    "sample_index": FieldLayout(Kind.ROW),
    "prompt_texts": FieldLayout(Kind.ROW),
    "response_texts": FieldLayout(Kind.ROW),
    "policy_version": FieldLayout(Kind.ROW),
    "reward_metrics": FieldLayout(Kind.METRICS),
    "kl_coef": FieldLayout(Kind.SCALAR),
    "batch_index": FieldLayout(Kind.SCALAR),
    "rollout_log_probs": FieldLayout(Kind.ACTION, _F32),
    "shaped_reward": FieldLayout(Kind.ROW, _F32),
    "action_entropy": FieldLayout(Kind.ACTION, _F32, optional=True),
    "packed_seq_lens": FieldLayout(Kind.ROW, _I64, optional=True),
    "reward_clip_frac": FieldLayout(Kind.SCALAR),
    "advantage_clip_frac": FieldLayout(Kind.SCALAR),
    "reward_norm_mean": FieldLayout(Kind.SCALAR),
    "reward_norm_std": FieldLayout(Kind.SCALAR),
    "dropped_prompt_indices": FieldLayout(Kind.BATCH, first_batch_only=True),
    "actor_policy_version": FieldLayout(Kind.SCALAR),
    "resampled_groups": FieldLayout(Kind.SCALAR, first_batch_only=True),
    "vision": FieldLayout(Kind.VISION, optional=True),
    "repaired_vision_tokens": FieldLayout(Kind.SCALAR, first_batch_only=True),
    "num_turns": FieldLayout(Kind.ROW),
    "rollout_is_weights": FieldLayout(Kind.ACTION, _F32, optional=True),
    "rollout_log_prob_abs_diff": FieldLayout(Kind.SCALAR),
    "rollout_kl": FieldLayout(Kind.SCALAR),
    "rollout_is_clip_frac": FieldLayout(Kind.SCALAR),
})

if tuple(EXPERIENCE_LAYOUT) != Experience._fields:  # one edit forgotten: fail at import, not in a stream
    raise ImportError(f"EXPERIENCE_LAYOUT lists {tuple(EXPERIENCE_LAYOUT)}, Experience has {Experience._fields}")


def fields_of(kind: Kind, *, tensor: bool | None = None, optional: bool | None = None) -> tuple[str, ...]:
    """Names of the Experience fields of ``kind`` in record order (filtered by being a tensor / optional)."""
    return tuple(
        name for name, layout in EXPERIENCE_LAYOUT.items()
        if layout.kind is kind
        and (tensor is None or layout.tensor == tensor)
        and (optional is None or layout.optional == optional)
    )


#: Per-action (B, A) fields: packed to (1, N), sliced to a batch's own response width.
ACTION_FIELDS = fields_of(Kind.ACTION)
#: Fields that go with the first of several batches cut from one estimate, with their reset values.
FIRST_BATCH_ONLY = MappingProxyType({
    name: Experience._field_defaults[name] for name, layout in EXPERIENCE_LAYOUT.items() if layout.first_batch_only
})

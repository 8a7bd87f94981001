"""Model inputs for the actor/reference/critic forward passes: padded rows or packed rows (pure).

Both layouts describe the same thing to a model: token ids, position ids, and which positions' hidden states
predict the response tokens. A model runs a :class:`ForwardChunk`, reads its outputs at ``hidden_index``, and
:meth:`ForwardChunk.to_rows` puts them back into (rows, A), so every model class is layout-agnostic.

- **padded**: ``micro_batch_size`` rows of the Rollout's (B, S) left/right-padded batch, with an attention mask.
- **packed**: the same rows concatenated without padding into one (1, T) row whose position ids restart at 0 for
  each sequence and without an attention mask; transformers then builds a block-diagonal causal mask from the
  position-id resets (no attention across sequences; flash-attention-2 uses the same resets for varlen kernels).
  Padding tokens are never computed, which is where mixed-length batches lose most time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.experience.types import Rollout


@dataclass(frozen=True)
class ForwardChunk:
    """One forward pass worth of rows.

    Shape:
        input_ids, position_ids: (b, L) int64 (b = rows, or 1 when packed);
        attention_mask: (b, L) int64, or None when packed;
        hidden_index: (K,) int64 positions in L whose outputs predict action tokens
            (K = A padded; K = sum of the rows' response lengths packed);
        targets: (b, K) int64 action tokens those positions predict;
        action_mask: (rows, A) bool of the chunk's rows.
    """

    rows: slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    action_mask: torch.Tensor

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    def to_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-position outputs (b, K) -> (rows, A) float32, 0 where a packed row has no action token."""
        if not self.packed:
            return outputs.float()
        out = torch.zeros(self.action_mask.shape, dtype=torch.float32)
        out[self.action_mask] = outputs[0].float().cpu()
        return out


def padded_chunks(rollout: Rollout, micro_batch_size: int) -> Iterator[ForwardChunk]:
    """The Rollout's padded rows, ``micro_batch_size`` at a time.

    Position ids count real tokens only (``cumsum(attention_mask) - 1``), so left padding does not shift
    positions; the last A + 1 positions but one predict the A response slots.
    """
    num_actions = rollout.action_mask.shape[1]
    width = rollout.sequences.shape[1]
    hidden_index = torch.arange(width - num_actions - 1, width - 1)
    for start in range(0, rollout.sequences.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        ids = rollout.sequences[rows]
        mask = rollout.attention_mask[rows]
        yield ForwardChunk(
            rows=rows,
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp_(min=0),
            hidden_index=hidden_index,
            targets=ids[:, -num_actions:],
            action_mask=rollout.action_mask[rows],
        )


def packed_chunks(rollout: Rollout, micro_batch_size: int) -> Iterator[ForwardChunk]:
    """The Rollout's rows without padding, ``micro_batch_size`` rows per (1, T) packed chunk."""
    for start in range(0, rollout.sequences.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        pieces, positions, hidden_index, targets = [], [], [], []
        offset = 0
        for row in range(*rows.indices(rollout.sequences.shape[0])):
            real = rollout.sequences[row][rollout.attention_mask[row].bool()]
            response_length = int(rollout.response_length[row])
            prompt_length = real.shape[0] - response_length
            pieces.append(real)
            positions.append(torch.arange(real.shape[0]))
            hidden_index.append(torch.arange(prompt_length - 1, prompt_length - 1 + response_length) + offset)
            targets.append(real[prompt_length:])
            offset += real.shape[0]
        yield ForwardChunk(
            rows=rows,
            input_ids=torch.cat(pieces).unsqueeze(0),
            attention_mask=None,
            position_ids=torch.cat(positions).unsqueeze(0),
            hidden_index=torch.cat(hidden_index),
            targets=torch.cat(targets).unsqueeze(0),
            action_mask=rollout.action_mask[rows],
        )


def chunks(rollout: Rollout, micro_batch_size: int, packed: bool) -> list[ForwardChunk]:
    """:func:`packed_chunks` or :func:`padded_chunks` of ``rollout``."""
    make = packed_chunks if packed else padded_chunks
    return list(make(rollout, micro_batch_size))


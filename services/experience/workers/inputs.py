"""Model inputs for the actor/reference/critic forward passes: padded, packed or shared-prompt rows (pure).

All layouts describe the same thing to a model: token ids, position ids, and which positions' hidden states
predict the response tokens. A model runs a :class:`ForwardChunk`, reads its outputs at ``hidden_index``, and
:meth:`ForwardChunk.to_rows` puts them back into (rows, A), so every model class is layout-agnostic.

- **padded**: ``micro_batch_size`` rows of the Rollout's (B, S) left/right-padded batch, with an attention mask.
- **packed**: the same rows concatenated without padding into one (1, T) row whose position ids restart at 0 for
  each sequence and without an attention mask; transformers then builds a block-diagonal causal mask from the
  position-id resets (no attention across sequences; flash-attention-2 uses the same resets for varlen kernels).
  Padding tokens are never computed, which is where mixed-length batches lose most time.
- **shared prompt**: packed, but the n samples of a prompt group share one copy of the prompt:
  ``[prompt, response_1, ..., response_n]`` with a (1, 1, T, T) attention mask in which each response attends to
  the prompt and causally to itself only, and position ids continuing the prompt's in each response. The prompt
  is computed once per group instead of n times (the prompt is usually most of a GSM8K row). Every response
  token sees exactly the context it has in the other layouts, so outputs agree up to float rounding.

Packed and shared-prompt chunks also carry their spans (:class:`~services.experience.workers.attention.SpanIndex`):
a model on span attention (:mod:`services.experience.workers.attention`) attends span by span instead of through
the (T, T) mask, whose blocks are mostly masked out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastexp.types import Rollout, VisionInputs
from services.experience.workers.attention import SPANS_KWARG, SpanIndex, span_index


@dataclass(frozen=True)
class ForwardChunk:
    """One forward pass worth of rows.

    Shape:
        input_ids, position_ids: (b, L) int64 (b = rows, or 1 when packed or shared);
        attention_mask: (b, L) int64 padded; None packed; (1, 1, L, L) bool shared (true = may attend);
        hidden_index: (K,) int64 positions in L whose outputs predict action tokens
            (padded: K = the chunk's longest response; packed, shared: K = sum of the rows' response lengths;
            shared: a group's first response tokens are all predicted from its prompt's last position);
        targets: (b, K) int64 action tokens those positions predict;
        action_mask: (rows, A) bool of the chunk's rows;
        vision: the rows' images/videos (padded layout only; None when the rows are text-only). A model given
            them computes its own multimodal positions (Qwen2-VL's M-RoPE) and ignores ``position_ids``.
        spans: where each position attends: its spans and responses, with a mask per response (packed and
            shared-prompt layouts; None padded).
    """

    rows: slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    action_mask: torch.Tensor
    vision: VisionInputs | None = None
    spans: SpanIndex | None = None

    @property
    def padded(self) -> bool:
        return self.attention_mask is not None and self.attention_mask.dim() == 2

    def model_mask(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The attention mask to pass to a transformers model: the padded (b, L) mask, None (packed), or the shared
        layout's 4D mask as an additive float mask in ``dtype`` (0 where allowed, the dtype's min elsewhere),
        which transformers uses as given for eager and SDPA attention."""
        mask = self.attention_mask
        if mask is None or mask.dim() == 2:
            return None if mask is None else mask.to(device)
        additive = torch.zeros(mask.shape, dtype=dtype)
        additive.masked_fill_(~mask, torch.finfo(dtype).min)
        return additive.to(device)

    def attention_inputs(self, dtype: torch.dtype, device: torch.device | str, span_attention: bool) -> dict:
        """The forward's attention keyword arguments: :meth:`model_mask`, and the chunk's spans for a model on span
        attention (:func:`~services.experience.workers.attention.use_span_attention`). The mask goes along anyway, so
        a layer the spans do not reach (a model that drops unknown keywords) attends under the right mask."""
        inputs = {"attention_mask": self.model_mask(dtype, device)}
        if span_attention and self.spans is not None:
            inputs[SPANS_KWARG] = self.spans.to(device)
        return inputs

    def to_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-position outputs (b, K) -> (rows, A) float32, 0 where a packed row has no action token."""
        if self.padded:  # (b, A_chunk) -> (b, A): the chunk was trimmed to its own rows' longest response
            return torch.nn.functional.pad(outputs.float(), (0, self.action_mask.shape[1] - outputs.shape[1]))
        out = torch.zeros(self.action_mask.shape, dtype=torch.float32)
        out[self.action_mask] = outputs[0].float().cpu()
        return out


def padded_chunks(rollout: Rollout, micro_batch_size: int) -> Iterator[ForwardChunk]:
    """The Rollout's padded rows, ``micro_batch_size`` at a time, each chunk trimmed to its own rows.

    A chunk keeps only the columns its rows need: left prompt padding beyond its longest prompt and response slots
    beyond its longest response are cut (so rows sorted by length waste little padding). Position ids count real
    tokens only (``cumsum(attention_mask) - 1``), so left padding does not shift positions; the chunk's last
    A_c + 1 positions but one predict its A_c response slots, and :meth:`ForwardChunk.to_rows` pads back to A.
    """
    prompt_width = rollout.sequences.shape[1] - rollout.action_mask.shape[1]
    for start in range(0, rollout.sequences.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        response_length = rollout.response_length[rows]
        num_actions = max(1, int(response_length.max()))
        left = prompt_width - int((rollout.total_length[rows] - response_length).max())
        ids = rollout.sequences[rows, left : prompt_width + num_actions]
        mask = rollout.attention_mask[rows, left : prompt_width + num_actions]
        width = ids.shape[1]
        yield ForwardChunk(
            rows=rows,
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp_(min=0),
            hidden_index=torch.arange(width - num_actions - 1, width - 1),
            targets=ids[:, -num_actions:],
            action_mask=rollout.action_mask[rows],
            vision=None if rollout.vision is None else rollout.vision.select(rows),
        )


def packed_chunks(rollout: Rollout, micro_batch_size: int) -> Iterator[ForwardChunk]:
    """The Rollout's rows without padding, ``micro_batch_size`` rows per (1, T) packed chunk."""
    for start in range(0, rollout.sequences.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        pieces, positions, hidden_index, targets, spans = [], [], [], [], []
        offset = 0
        for row in range(*rows.indices(rollout.sequences.shape[0])):
            real = rollout.sequences[row][rollout.attention_mask[row].bool()]
            response_length = int(rollout.response_length[row])
            prompt_length = real.shape[0] - response_length
            spans.append((offset, real.shape[0], ()))
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
            spans=span_index(spans),
        )


def shared_prompt_chunks(rollout: Rollout, micro_batch_size: int) -> Iterator[ForwardChunk]:
    """The Rollout's rows without padding, ``micro_batch_size`` rows per (1, T) chunk, consecutive rows of one prompt
    sharing a single copy of it (see the module docstring). Rows of a group split across chunks get a copy each.
    """
    total_rows = rollout.sequences.shape[0]
    for start in range(0, total_rows, micro_batch_size):
        rows = slice(start, min(total_rows, start + micro_batch_size))
        pieces, positions, hidden_index, targets, spans = [], [], [], [], []
        offset, prompt_start, prompt = 0, 0, None
        for row in range(rows.start, rows.stop):
            real = rollout.sequences[row][rollout.attention_mask[row].bool()]
            response_length = int(rollout.response_length[row])
            prompt_length = real.shape[0] - response_length
            if prompt is None or not torch.equal(prompt, real[:prompt_length]):
                prompt, prompt_start = real[:prompt_length], offset
                pieces.append(prompt)
                positions.append(torch.arange(prompt_length))
                spans.append((offset, prompt_length, None))
                offset += prompt_length
            response = real[prompt_length:]
            pieces.append(response)
            positions.append(torch.arange(prompt_length, prompt_length + response_length))
            # token 0 is predicted from the prompt's last position, token j > 0 from response token j - 1
            hidden_index.append(torch.cat([
                torch.tensor([prompt_start + prompt_length - 1]), torch.arange(offset, offset + max(0, response_length - 1))
            ])[:response_length])
            targets.append(response)
            spans.append((offset, response_length, (prompt_start, prompt_length)))
            offset += response_length
        mask = torch.zeros((offset, offset), dtype=torch.bool)
        groups: dict[int, tuple[int, int, list[tuple[int, int]]]] = {}
        for begin, length, context in spans:
            mask[begin : begin + length, begin : begin + length] = torch.ones(length, length, dtype=torch.bool).tril()
            if context is None:
                groups[begin] = (begin, length, [])
            else:
                mask[begin : begin + length, context[0] : context[0] + context[1]] = True
                groups[context[0]][2].append((begin, length))
        yield ForwardChunk(
            rows=rows,
            input_ids=torch.cat(pieces).unsqueeze(0),
            attention_mask=mask[None, None],
            position_ids=torch.cat(positions).unsqueeze(0),
            hidden_index=torch.cat(hidden_index),
            targets=torch.cat(targets).unsqueeze(0),
            action_mask=rollout.action_mask[rows],
            spans=span_index(list(groups.values())),
        )


LAYOUTS = {"padded": padded_chunks, "packed": packed_chunks, "shared_prompt": shared_prompt_chunks}


def chunks(rollout: Rollout, micro_batch_size: int, packed: bool, share_prompt: bool = False) -> list[ForwardChunk]:
    """:func:`padded_chunks`, :func:`packed_chunks`, or with ``share_prompt`` :func:`shared_prompt_chunks`.

    Rows with images or videos always take the padded layout (their positions are the model's own M-RoPE).
    """
    layout = ("shared_prompt" if share_prompt else "packed") if packed and rollout.vision is None else "padded"
    return list(LAYOUTS[layout](rollout, micro_batch_size))


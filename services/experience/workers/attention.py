"""Attention over a packed chunk's spans instead of one (T, T) mask (the packed and shared-prompt layouts).

A packed chunk lays several sequences end to end in one (1, T) row; a shared-prompt chunk lays out
``[prompt, response_1, ..., response_n]`` per group (:mod:`services.experience.workers.inputs`). Either way a
token attends to few of the T positions: its own sequence (packed), or its group's prompt and, causally, its own
response (shared prompt). SDPA given the (T, T) mask computes every block of it anyway; with two groups of four
256-token responses on 104-token prompts (T ~ 1,900), 88 % of that work is masked out.

Here one layer's attention is two SDPA calls over gathered rows:

- **spans** (a packed sequence, or a group's prompt): each of the G spans causally over itself,
  queries (G, H, P, d) against keys (G, H_kv, P, d), P the longest span;
- **responses** (shared prompt only): each of the R responses over its group's prompt, then causally over itself,
  queries (R, H, L, d) against keys (R, H_kv, P + L, d): the prompt's keys in the first P slots, the response's
  from slot P on.

Shorter rows are padded and masked. Every query sees the keys, values and scaling it sees under the (T, T) mask,
so outputs agree with it up to float summation order (``tests/unit/test_span_attention.py``). The implementation is
registered with transformers' ``AttentionInterface`` under :data:`SPAN_ATTENTION` and takes the place of ``sdpa`` in
models that select their attention through that interface (:func:`use_span_attention`); a call without
:data:`SPANS_KWARG` (padded chunks, generation) is transformers' own SDPA with its own masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: The attention implementation's name in transformers' registries.
SPAN_ATTENTION = "fastexp_spans"
#: The forward keyword that carries a chunk's :class:`SpanIndex` down to each attention layer.
SPANS_KWARG = "fastexp_spans"


@dataclass(frozen=True)
class SpanIndex:
    """Where each query of a packed chunk looks, as index tensors into its T positions.

    Shape:
        span_index: (G, P) int64, the positions of each causal span (padded with 0); span_mask: (G, 1, P, P) bool,
            causal within the span (a padded query attends to its own slot only).
        response_index: (R, L) int64, each response's positions; context_index: (R, P + L) int64, its prompt's
            positions then its own; response_mask: (R, 1, L, P + L) bool. R = 0 for a packed chunk.
        span_rows, response_rows: (n,) int64, the real (unpadded) queries' slots in the flattened (G * P) or
            (R * L) rows; span_positions, response_positions: (n,) int64, their positions in the chunk.
    """

    span_index: torch.Tensor
    span_mask: torch.Tensor
    span_rows: torch.Tensor
    span_positions: torch.Tensor
    response_index: torch.Tensor
    context_index: torch.Tensor
    response_mask: torch.Tensor
    response_rows: torch.Tensor
    response_positions: torch.Tensor

    def to(self, device: torch.device | str) -> SpanIndex:
        return SpanIndex(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))


def span_index(spans: Sequence[tuple[int, int, Sequence[tuple[int, int]]]]) -> SpanIndex:
    """The :class:`SpanIndex` of a chunk from its spans.

    Args:
        spans: per causal span ``(start, length, responses)``: ``responses`` lists ``(start, length)`` of each
            response that attends to the whole span first (a shared prompt's); empty for a packed sequence.
            Spans and responses must tile positions ``0..T-1`` without overlap; lengths >= 1, responses may be 0.
    """
    longest = max(length for _, length, _ in spans)
    responses = [(start, length, response) for start, length, group in spans for response in group]
    span_idx = torch.zeros(len(spans), longest, dtype=torch.long)
    span_valid = torch.zeros(len(spans), longest, dtype=torch.bool)
    span_mask = torch.eye(longest, dtype=torch.bool).repeat(len(spans), 1, 1, 1)
    for g, (start, length, _) in enumerate(spans):
        span_idx[g, :length] = torch.arange(start, start + length)
        span_valid[g, :length] = True
        span_mask[g, 0, :length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    width = max([length for _, _, (_, length) in responses], default=0)
    response_idx = torch.zeros(len(responses), width, dtype=torch.long)
    context_idx = torch.zeros(len(responses), longest + width, dtype=torch.long)
    response_mask = torch.zeros(len(responses), 1, width, longest + width, dtype=torch.bool)
    response_valid = torch.zeros(len(responses), width, dtype=torch.bool)
    for r, (prompt_start, prompt_length, (start, length)) in enumerate(responses):
        response_idx[r, :length] = torch.arange(start, start + length)
        response_valid[r, :length] = True
        context_idx[r, :prompt_length] = torch.arange(prompt_start, prompt_start + prompt_length)
        context_idx[r, longest : longest + length] = torch.arange(start, start + length)
        response_mask[r, 0, :, :prompt_length] = True  # padded queries too: never a row with nothing to attend
        response_mask[r, 0, :length, longest : longest + length] = torch.ones(length, length, dtype=torch.bool).tril()
    span_rows, response_rows = span_valid.reshape(-1).nonzero()[:, 0], response_valid.reshape(-1).nonzero()[:, 0]
    return SpanIndex(span_idx, span_mask, span_rows, span_idx.reshape(-1)[span_rows],
                     response_idx, context_idx, response_mask, response_rows, response_idx.reshape(-1)[response_rows])


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], scaling: float | None,
            out: torch.Tensor) -> None:
    """SDPA over gathered rows, written into ``out`` (T, H, d) at the real queries' positions.

    ``query`` (T, H, d), ``key``/``value`` (T, H_kv, d) (token-major: each position's heads are one contiguous row to
    gather); ``rows``: ``(query_index (N, Lq), key_index (N, Lk), mask (N, 1, Lq, Lk), real (n,), positions (n,))``
    as in :class:`SpanIndex`.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    query_index, key_index, mask, real, positions = rows
    if real.numel() == 0:
        return
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    q = query.index_select(0, query_index.reshape(-1)).view(*query_index.shape, heads, dim).transpose(1, 2)
    k = key.index_select(0, key_index.reshape(-1)).view(*key_index.shape, kv_heads, dim).transpose(1, 2)
    v = value.index_select(0, key_index.reshape(-1)).view(*key_index.shape, kv_heads, dim).transpose(1, 2)
    extra: dict[str, Any] = {}
    if heads != kv_heads:
        if use_gqa_in_sdpa(mask, k, v):
            extra["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, **extra)
    flat = attended.transpose(1, 2).reshape(-1, heads, dim)  # (N * Lq, H, d)
    out.index_copy_(0, positions, flat.index_select(0, real))


def span_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` (1, H, T, d), ``key``/``value`` (1, H_kv, T, d) ->
    ``(output (1, T, H, d), None)``. With :data:`SPANS_KWARG` in ``kwargs``, attention over the chunk's spans
    (the module docstring; ``attention_mask`` is ignored, dropout is not supported: forwards here are eval-only);
    without it, transformers' ``sdpa_attention_forward``.

    Raises:
        ValueError: spans given with a batch of more than one row, or with dropout.
    """
    spans: SpanIndex | None = kwargs.pop(SPANS_KWARG, None)
    if spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or dropout:
        raise ValueError("span attention takes one packed row and no dropout")
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (T, H, d)
    query, key, value = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (T, heads, d) views
    _attend(query, key, value, (spans.span_index, spans.span_index, spans.span_mask, spans.span_rows,
                                spans.span_positions), scaling, out)
    _attend(query, key, value, (spans.response_index, spans.context_index, spans.response_mask, spans.response_rows,
                                spans.response_positions), scaling, out)
    return out.unsqueeze(0), None


def use_span_attention(model: Any) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` to :func:`span_attention` where it selects its attention through
    transformers' ``AttentionInterface``; models on another implementation (eager, flash-attention) keep theirs.

    Returns:
        Whether ``model`` now runs span attention (its packed chunks then take :data:`SPANS_KWARG`).
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", SPAN_ATTENTION):
        return False
    AttentionInterface.register(SPAN_ATTENTION, span_attention)
    AttentionMaskInterface.register(SPAN_ATTENTION, sdpa_mask)  # calls without spans build SDPA's masks
    if config._attn_implementation == "sdpa":
        model.set_attn_implementation(SPAN_ATTENTION)  # warns and keeps sdpa where the model cannot switch
    return config._attn_implementation == SPAN_ATTENTION

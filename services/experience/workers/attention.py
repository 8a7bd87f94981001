"""Attention over a packed chunk's spans instead of one (T, T) mask (the packed and shared-prompt layouts).

A packed chunk lays several sequences end to end in one (1, T) row; a shared-prompt chunk lays out
``[prompt, response_1, ..., response_n]`` per group (:mod:`services.experience.workers.inputs`). Either way a
token attends to few of the T positions: its own sequence (packed), or its group's prompt and, causally, its own
response (shared prompt). SDPA given the (T, T) mask computes every block of it anyway; with two groups of four
256-token responses on 104-token prompts (T ~ 1,900), 88 % of that work is masked out.

Here one layer's attention is one SDPA call per span, on views of the chunk's queries, keys and values:

- **a span** (a packed sequence, or a group's prompt) causally over itself: queries (H, P, d) against keys
  (H_kv, P, d), SDPA's own ``is_causal`` (its CPU flash kernel skips the blocks above the diagonal);
- **a response** (shared prompt only) over its group's prompt, then causally over itself: queries (H, L, d) against
  keys (H_kv, P + L, d), the prompt's keys followed by its own, under an (L, P + L) mask built once per chunk.

Nothing is padded: a first version gathered every response into one (R, H, L_max, d) batch and ran 1.28x slower
than the (T, T) mask on long-tailed response lengths (`benchmarks/packing.py`). Every query sees the keys, values and
scaling it sees under the (T, T) mask, so outputs agree with it up to float summation order
(``tests/unit/test_span_attention.py``). The implementation is registered with transformers' ``AttentionInterface``
under :data:`SPAN_ATTENTION` and takes the place of ``sdpa`` in models that select their attention through that
interface (:func:`use_span_attention`); a call without :data:`SPANS_KWARG` (padded chunks, generation) is
transformers' own SDPA with its own masks.
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
    """Where each query of a packed chunk looks.

    Shape:
        spans: ``(start, length)`` of each causal span, positions in the chunk's T.
        responses: ``(prompt_start, prompt_length, start, length)`` of each response that attends to a prompt
            (shared-prompt layout; empty for a packed chunk); masks: one (length, prompt_length + length) bool per
            response, true where it may attend (the whole prompt, then causally itself).
    """

    spans: tuple[tuple[int, int], ...]
    responses: tuple[tuple[int, int, int, int], ...]
    masks: tuple[torch.Tensor, ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SpanIndex:
        """The masks on ``device`` (accelerate's per-layer hooks call this with ``non_blocking``)."""
        return SpanIndex(self.spans, self.responses,
                         tuple(mask.to(device, non_blocking=non_blocking) for mask in self.masks))


def span_index(spans: Sequence[tuple[int, int, Sequence[tuple[int, int]]]]) -> SpanIndex:
    """The :class:`SpanIndex` of a chunk from its spans.

    Args:
        spans: per causal span ``(start, length, responses)``: ``responses`` lists ``(start, length)`` of each
            response that attends to the whole span first (a shared prompt's); empty for a packed sequence.
            Spans and responses must tile positions ``0..T-1`` without overlap; lengths >= 1, responses may be 0.
    """
    responses = tuple((start, length, *response) for start, length, group in spans for response in group
                      if response[1] > 0)
    masks = tuple(torch.cat([torch.ones(length, prompt_length, dtype=torch.bool),
                             torch.ones(length, length, dtype=torch.bool).tril()], dim=1)
                  for _, prompt_length, _, length in responses)
    return SpanIndex(tuple((start, length) for start, length, _ in spans), responses, masks)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
          scaling: float | None) -> torch.Tensor:
    """SDPA of ``query`` (H, L, d) over ``key``/``value`` (H_kv, S, d), causal when ``mask`` (L, S) is None;
    (H, L, d). Called with a batch of one: PyTorch's CPU flash kernel takes 4D inputs only (3D ran its math path,
    3x slower here)."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

    query, key, value = query[None], key[None], value[None]
    mask = None if mask is None else mask[None, None]
    extra: dict[str, Any] = {"is_causal": mask is None}
    if query.shape[1] != key.shape[1]:
        if use_gqa_in_sdpa(mask, key, value):
            extra["enable_gqa"] = True
        else:
            key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // key.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                            **extra)[0]


def span_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` (1, H, T, d), ``key``/``value`` (1, H_kv, T, d) ->
    ``(output (1, T, H, d), None)``. With :data:`SPANS_KWARG` in ``kwargs``, attention over the chunk's spans
    (the module docstring; ``attention_mask`` is ignored, dropout is not supported: forwards here are eval-only);
    without it, transformers' ``sdpa_attention_forward``.

    Raises:
        ValueError: spans given with a batch of more than one row, with dropout, or to a layer with a sliding window,
            logit soft-capping or attention sinks (:func:`use_span_attention` leaves such models on SDPA).
    """
    spans: SpanIndex | None = kwargs.pop(SPANS_KWARG, None)
    if spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or dropout:
        raise ValueError("span attention takes one packed row and no dropout")
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"span attention does not apply {', '.join(unsupported)}")
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (T, H, d)
    query, key, value = query[0], key[0], value[0]  # (H, T, d), (H_kv, T, d)
    for start, length in spans.spans:
        end = start + length
        out[start:end] = _sdpa(query[:, start:end], key[:, start:end], value[:, start:end], None,
                               scaling).transpose(0, 1)
    for (prompt_start, prompt_length, start, length), mask in zip(spans.responses, spans.masks, strict=True):
        context = (slice(prompt_start, prompt_start + prompt_length), slice(start, start + length))
        keys = torch.cat([key[:, part] for part in context], dim=1)
        values = torch.cat([value[:, part] for part in context], dim=1)
        out[start : start + length] = _sdpa(query[:, context[1]], keys, values, mask, scaling).transpose(0, 1)
    return out.unsqueeze(0), None


def plain_causal(config: Any) -> bool:
    """Whether every layer of ``config``'s model attends causally to all earlier positions, unscaled: no sliding
    window (Mistral, Qwen2 with ``use_sliding_window``, Gemma's local layers, Phi-3), no logit soft-capping
    (Gemma 2), no bidirectional attention. Span attention and the shared-prompt layout's mask reproduce only that."""
    layer_types = getattr(config, "layer_types", None) or ()
    return (getattr(config, "is_causal", True) and not getattr(config, "sliding_window", None)
            and not getattr(config, "attn_logit_softcapping", None)
            and all(kind == "full_attention" for kind in layer_types))


def use_span_attention(model: Any) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` to :func:`span_attention` where it selects its attention through
    transformers' ``AttentionInterface`` and every layer attends plainly causally (:func:`plain_causal`); models on
    another implementation (eager, flash-attention) or with windows, soft-capping or bidirectional layers keep theirs.

    Returns:
        Whether ``model`` now runs span attention (its packed chunks then take :data:`SPANS_KWARG`).
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", SPAN_ATTENTION):
        return False
    if not plain_causal(config):
        return False
    AttentionInterface.register(SPAN_ATTENTION, span_attention)
    AttentionMaskInterface.register(SPAN_ATTENTION, sdpa_mask)  # calls without spans build SDPA's masks
    if config._attn_implementation == "sdpa":
        model.set_attn_implementation(SPAN_ATTENTION)  # warns and keeps sdpa where the model cannot switch
    return config._attn_implementation == SPAN_ATTENTION

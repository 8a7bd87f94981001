"""Span attention (services/experience/workers/attention.py) against SDPA under the chunk's own (T, T) mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.generation import CompletionRecord
from services.experience.config import PromptSpec
from services.experience.workers.attention import SPANS_KWARG, span_attention, span_index
from services.experience.workers.inputs import chunks
from services.experience.workers.sequences import build_rollout

HEADS, KV_HEADS, DIM = 4, 2, 8


def _rollout():
    """Three groups: prompts of 5, 2 and 3 tokens; responses of mixed lengths, one of them empty."""
    prompts = [(11, 12, 13, 14, 15), (21, 22), (31, 32, 33)]
    responses = [[(101, 102), (103,), (104, 105, 106, 107)], [(201, 202, 203), ()], [(301,), (302, 303)]]
    specs = tuple(PromptSpec(f"p{i}", p, "", "") for i, p in enumerate(prompts))
    records = [CompletionRecord(i, s, prompts[i], r, np.zeros(len(r), np.float32), "stop", "x", 0)
               for i, group in enumerate(responses) for s, r in enumerate(group)]
    return build_rollout(records, specs, 2)


def _dense_mask(chunk) -> torch.Tensor:
    """(1, 1, T, T) bool: the shared layout's own mask, or the packed layout's block-diagonal causal mask (a
    sequence starts where position ids restart at 0)."""
    if chunk.attention_mask is not None:
        return chunk.attention_mask
    sequence = (chunk.position_ids[0] == 0).cumsum(0)
    same = sequence[:, None] == sequence[None, :]
    return (same & torch.ones_like(same).tril())[None, None]


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("micro_batch_size", [1, 3, 4, 7])  # 3, 4: groups split across chunks
def test_span_attention_equals_sdpa_under_the_chunks_mask(share_prompt, micro_batch_size):
    generator = torch.Generator().manual_seed(micro_batch_size)
    for chunk in chunks(_rollout(), micro_batch_size, packed=True, share_prompt=share_prompt):
        length = chunk.input_ids.shape[1]
        query = torch.randn(1, HEADS, length, DIM, generator=generator, dtype=torch.float64)
        key, value = (torch.randn(1, KV_HEADS, length, DIM, generator=generator, dtype=torch.float64)
                      for _ in range(2))
        got, _ = span_attention(torch.nn.Module(), query, key, value, None, scaling=0.3,
                                **{SPANS_KWARG: chunk.spans})
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=_dense_mask(chunk), scale=0.3
        ).transpose(1, 2)  # (1, T, H, d), as transformers' attention functions return
        assert got.shape == expected.shape == (1, length, HEADS, DIM)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_span_index_of_a_shared_prompt_group():
    # one group: prompt at 0..2, responses at 3..4, 5..7 and an empty one; and a lone packed sequence at 8..9
    index = span_index([(0, 3, [(3, 2), (5, 3), (8, 0)]), (8, 2, [])])
    assert index.spans == ((0, 3), (8, 2))
    assert index.responses == ((0, 3, 3, 2), (0, 3, 5, 3))  # the empty response attends to nothing
    # the first response: the whole prompt, then itself causally
    assert index.masks[0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert index.masks[1].shape == (3, 6)


def test_span_attention_refuses_a_batch_and_dropout():
    chunk = chunks(_rollout(), 2, packed=True)[0]
    length = chunk.input_ids.shape[1]
    query, key = torch.zeros(2, HEADS, length, DIM), torch.zeros(2, KV_HEADS, length, DIM)
    with pytest.raises(ValueError, match="one packed row"):
        span_attention(torch.nn.Module(), query, key, key, None, **{SPANS_KWARG: chunk.spans})
    with pytest.raises(ValueError, match="no dropout"):
        span_attention(torch.nn.Module(), query[:1], key[:1], key[:1], None, dropout=0.1, **{SPANS_KWARG: chunk.spans})
    with pytest.raises(ValueError, match="sliding_window"):
        span_attention(torch.nn.Module(), query[:1], key[:1], key[:1], None, sliding_window=4,
                       **{SPANS_KWARG: chunk.spans})

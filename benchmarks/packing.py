"""Packed and shared-prompt vs padded actor forward (log-probs of the response tokens) on mixed lengths, in one run.

Figures: ``packed_vs_padded`` = median packed time / median padded time for the same rows and the same rows per
forward pass (below 1: packing is faster); ``shared_prompt_vs_padded`` the same for packed rows whose prompt group
shares one copy of its prompt (:func:`services.experience.workers.inputs.shared_prompt_chunks`); ``packing_padding_fraction`` = share of the padded batch's tokens that are padding;
``packing_max_abs_logprob_diff`` = max |packed - padded| log-prob over the action tokens (different kernels,
so float rounding differs: bf16 on the embedded model; in float32 they agree to ~1e-5); ``span_attention_vs_mask``
= the shared-prompt forward attending span by span (the service's, :mod:`services.experience.workers.attention`)
over the same chunks under SDPA with their (T, T) mask, another copy of the model in the same process. Rows mimic a GSM8K
rollout: groups of ``n`` samples of one prompt, prompt lengths uniform in [40, 160] tokens, response lengths
long-tailed in [8, max_response] (a quarter of them near the maximum), token ids drawn from the vocabulary.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from fastexp.types import Rollout
from services.common.generation import CompletionRecord
from services.experience.config import PromptSpec
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import DTYPES, LogProbModel
from services.experience.workers.sequences import build_rollout


def make_rollout(
    rows: int, max_response: int, vocab_size: int, pad_token_id: int, seed: int = 0, n: int = 4
) -> Rollout:
    """A padded Rollout of ``rows`` rows (groups of ``n`` consecutive rows share a prompt) with mixed prompt and
    response lengths (see the module docstring)."""
    rng = np.random.default_rng(seed)
    prompt_lengths = np.repeat(rng.integers(40, 161, -(-rows // n)), n)[:rows]
    response_lengths = np.where(
        rng.random(rows) < 0.25, rng.integers(max_response * 3 // 4, max_response + 1, rows),
        rng.integers(8, max(9, max_response // 3), rows),
    )
    specs, records = [], []
    for i in range(rows):
        if i % n == 0:
            prompt = tuple(int(t) for t in rng.integers(3, vocab_size, prompt_lengths[i]))
            specs.append(PromptSpec(f"p{i // n}", prompt, "", ""))
        response = tuple(int(t) for t in rng.integers(3, vocab_size, response_lengths[i]))
        records.append(CompletionRecord(i // n, i % n, prompt, response, np.zeros(len(response), np.float32),
                                        "length", "", 0))
    return build_rollout(records, specs, pad_token_id)


def run(
    model_path: str, rows: int = 32, max_response: int = 256, micro_batch_size: int = 8, repeats: int = 3,
    dtype: str = "bfloat16",
) -> dict:
    """Time the same rows padded and packed through one LogProbModel; returns the figures and the settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    model = LogProbModel.load(model_path, dtype=dtype, device="cpu")
    rollout = make_rollout(rows, max_response, config.vocab_size, pad_token_id=config.eos_token_id or 0)
    mask = rollout.action_mask
    padded_parts = chunks(rollout, micro_batch_size, packed=False)
    packed_parts = chunks(rollout, micro_batch_size, packed=True)
    shared_parts = chunks(rollout, micro_batch_size, packed=True, share_prompt=True)

    def median_seconds(forward: LogProbModel, parts) -> tuple[float, torch.Tensor]:
        out, _ = forward.action_log_probs(parts)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            out, _ = forward.action_log_probs(parts)
            times.append(time.perf_counter() - started)
        return statistics.median(times), out

    padded_s, padded = median_seconds(model, padded_parts)
    packed_s, packed = median_seconds(model, packed_parts)
    shared_s, shared = median_seconds(model, shared_parts)
    masked = LogProbModel(AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval(),
                          span_attention=False)
    masked_s, masked_out = median_seconds(masked, shared_parts)
    real_tokens = int(rollout.attention_mask.sum())
    return {
        "packed_vs_padded": packed_s / padded_s,
        "shared_prompt_vs_padded": shared_s / padded_s,
        "span_attention_vs_mask": shared_s / masked_s,
        "span_attention_max_abs_logprob_diff": float((shared[mask] - masked_out[mask]).abs().max()),
        "packing_shared_prompt_mask_s": masked_s,
        "shared_prompt_max_abs_logprob_diff": float((shared[mask] - padded[mask]).abs().max()),
        "packing_padding_fraction": 1.0 - real_tokens / rollout.attention_mask.numel(),
        "packing_max_abs_logprob_diff": float((packed[mask] - padded[mask]).abs().max()),
        "packing_mean_abs_logprob_diff": float((packed[mask] - padded[mask]).abs().mean()),
        "packing_padded_s": padded_s,
        "packing_packed_s": packed_s,
        "packing_shared_prompt_s": shared_s,
        "packing_rows_micro_batch_tokens": [rows, micro_batch_size, real_tokens],
        "packing_model_dtype": f"{config.model_type} {dtype}",
    }

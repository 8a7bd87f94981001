"""LoRA adapter checks (names, shapes, dtypes, rank) on a hand-written two-layer spec, and the table of live and
superseded adapter versions."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.lora import AdapterConfig, all_finite, check_adapter, expected_tensors, linear_modules
from services.common.weights import TensorSpec
from services.generator.adapters import AdapterTable

# Two layers of a Llama-like model: hidden 8, q 8 -> 8, v 8 -> 4 (grouped KV heads), MLP 8 -> 16 -> 8.
SPEC = {
    "model.embed_tokens.weight": TensorSpec((32, 8), "bfloat16"),
    "lm_head.weight": TensorSpec((32, 8), "bfloat16"),
    "model.norm.weight": TensorSpec((8,), "bfloat16"),
    **{f"model.layers.{i}.self_attn.q_proj.weight": TensorSpec((8, 8), "bfloat16") for i in range(2)},
    **{f"model.layers.{i}.self_attn.v_proj.weight": TensorSpec((4, 8), "bfloat16") for i in range(2)},
    **{f"model.layers.{i}.mlp.up_proj.weight": TensorSpec((16, 8), "bfloat16") for i in range(2)},
    **{f"model.layers.{i}.input_layernorm.weight": TensorSpec((8,), "bfloat16") for i in range(2)},
}
MODULES = linear_modules(SPEC)
CONFIG = AdapterConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))


def adapter(config: AdapterConfig = CONFIG) -> dict[str, torch.Tensor]:
    return {name: torch.ones(shape) for name, shape in expected_tensors(config, MODULES).items()}


def test_linear_modules_are_the_2d_layers_without_embeddings_and_head():
    assert MODULES["model.layers.1.self_attn.v_proj"] == (4, 8)  # (out_features, in_features)
    assert len(MODULES) == 6
    assert not any("embed" in m or "lm_head" in m or "norm" in m for m in MODULES)


def test_expected_names_and_shapes_follow_peft():
    expected = expected_tensors(CONFIG, MODULES)
    assert len(expected) == 8  # 2 layers x (q, v) x (A, B)
    assert expected["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"] == (2, 8)  # (rank, in)
    assert expected["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] == (4, 2)  # (out, rank)
    # peft's rule: an entry matches the module's last names at a dot boundary, not a substring
    assert not expected_tensors(AdapterConfig(2, 4.0, ("proj",)), MODULES)
    assert len(expected_tensors(AdapterConfig(2, 4.0, ("self_attn.q_proj",)), MODULES)) == 4


def test_a_good_adapter_passes():
    check_adapter("run-a", CONFIG, adapter(), MODULES, max_rank=16)
    check_adapter("run-a", CONFIG, {k: v.bfloat16() for k, v in adapter().items()}, MODULES, max_rank=16)


@pytest.mark.parametrize(("change", "field", "reason"), [
    (lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(3, 8)}),
     "tensors[base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight]", "shape (3, 8); expected (2, 8)"),
    (lambda t: t.update({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(2, 8)}),
     "tensors[base_model.model.model.layers.0.mlp.up_proj.lora_A.weight]", "not a LoRA tensor"),
    (lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(2, 8)}),
     "tensors[base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight]", "not a LoRA tensor"),
    (lambda t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
     "tensors[base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight]", "missing"),
    (lambda t: t.update({"base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight": torch.ones(4, 2).int()}),
     "tensors[base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight]", "dtype int32"),
    (lambda t: t.update({"base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight":
                         torch.tensor([[1.0, float("nan")]] * 4)}),
     "tensors[base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight]", "NaN"),
])
def test_a_bad_tensor_is_named(change, field, reason):
    tensors = adapter()
    change(tensors)
    with pytest.raises(InvalidRequest) as raised:
        check_adapter("run-a", CONFIG, tensors, MODULES, max_rank=16)
    assert raised.value.field == field
    assert reason in raised.value.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_every_nan_and_infinity_and_passes_extreme_finite_values(dtype):
    values = torch.linspace(-3, 3, 1001).to(dtype).reshape(7, 143)
    info = torch.finfo(dtype)
    for finite in (info.max, info.min, info.tiny, info.tiny / 4, 0.0, -0.0):  # subnormals included
        changed = values.clone()
        changed[3, 5] = finite
        assert all_finite(changed) and all_finite(changed.t())  # a transposed view read in place
    for bad in (float("nan"), float("inf"), float("-inf")):
        changed = values.clone()
        changed[6, 142] = bad
        assert not all_finite(changed) and not all_finite(changed.t()) and not all_finite(changed[6])
    assert all_finite(torch.empty(0, 4, dtype=dtype))
    outside = values.clone()
    outside[0, 0] = float("nan")
    assert all_finite(outside[1:]) and all_finite(outside[:, 1:].t())  # only the view's own values count


@pytest.mark.parametrize(("name", "config", "field"), [
    ("run-a", AdapterConfig(32, 4.0, ("q_proj",)), "config.rank"),
    ("run-a", AdapterConfig(0, 4.0, ("q_proj",)), "config.rank"),
    ("run-a", AdapterConfig(2, 0.0, ("q_proj",)), "config.alpha"),
    ("run-a", AdapterConfig(2, 4.0, ("o_proj",)), "config.target_modules"),
    ("", CONFIG, "adapter"),
    ("../etc", CONFIG, "adapter"),
])
def test_a_bad_config_or_name_is_named(name, config, field):
    with pytest.raises(InvalidRequest) as raised:
        check_adapter(name, config, adapter(CONFIG), MODULES, max_rank=16)
    assert raised.value.field == field


def test_scaling_is_alpha_over_rank_or_its_root_with_rslora():
    assert AdapterConfig(4, 8.0, ("q_proj",)).scaling == 2.0  # 8 / 4
    assert AdapterConfig(4, 8.0, ("q_proj",), use_rslora=True).scaling == 4.0  # 8 / sqrt(4)


def test_table_versions_and_retirement():
    table = AdapterTable()
    first = table.next_slot("a", CONFIG, None)
    assert (first.version, first.slot_id) == (1, 1)
    assert table.publish(first) == []
    running = table.acquire("a")
    assert running == first
    second = table.next_slot("a", CONFIG, None)
    assert second.version == 2 and second.slot_id != first.slot_id
    assert table.publish(second) == []  # the first still has a request: retired by its release
    assert table.acquire("a") == second
    assert table.release(running) is True  # superseded and idle now
    assert table.release(second) is False  # live: kept
    third = table.next_slot("a", CONFIG, 7)
    assert third.version == 7
    assert table.publish(third) == [second]  # nothing runs on the second: retire at once
    with pytest.raises(InvalidRequest, match="no adapter named 'b'"):
        table.acquire("b")


def test_cpu_lora_ops_apply_each_rows_adapter_and_none_to_rows_without():
    from services.generator.vllm_cpu_lora import bgmv_expand, bgmv_expand_slice, bgmv_shrink

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 1, 2, 5, generator=g)  # 3 adapter slots: A (rank 2, in 5)
    b = torch.randn(3, 1, 4, 2, generator=g)  # B (out 4, rank 2)
    x = torch.randn(4, 5, generator=g)
    indices = torch.tensor([2, -1, 0, 2])  # row 1 has no adapter (vLLM's -1), not the last slot's
    shrunk = torch.full((4, 2), 7.0)
    bgmv_shrink(x, a, shrunk, indices, scaling=0.5)
    for row, slot in enumerate(indices.tolist()):
        expected = torch.zeros(2) if slot < 0 else 0.5 * a[slot, 0] @ x[row]  # scaling * A x
        torch.testing.assert_close(shrunk[row], expected)
    out = torch.ones(4, 6)
    bgmv_expand(shrunk, b, out, indices, add_inputs=True)  # the 4 common columns of 6 get B h added
    bgmv_expand_slice(shrunk, b, sliced := torch.ones(4, 6), indices, 2, 4, add_inputs=True)
    for row, slot in enumerate(indices.tolist()):
        delta = torch.zeros(4) if slot < 0 else b[slot, 0] @ shrunk[row]
        torch.testing.assert_close(out[row], torch.cat([1 + delta, torch.ones(2)]))
        torch.testing.assert_close(sliced[row], torch.cat([torch.ones(2), 1 + delta]))


@pytest.mark.parametrize("rows", [6, 40])  # a decode batch (float32 products), a prefill's (the output's dtype)
@pytest.mark.parametrize("slot", [1, -1, 2])
def test_cpu_lora_ops_on_a_batch_of_one_adapter_or_none_match_the_per_row_result(slot, rows):
    """A batch whose rows all share one adapter takes one matmul; none where no row has an adapter (the base
    model's batch) or, past SMALL_BATCH_ROWS rows, where the adapter's matrix is zero (slot 2 here: a module it does
    not target). The same deltas, row by row, and the buffers written as the per-row ops write them."""
    from services.generator.vllm_cpu_lora import bgmv_expand, bgmv_expand_slice, bgmv_shrink

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 1, 2, 5, generator=g), torch.randn(3, 1, 4, 2, generator=g)
    a[2], b[2] = 0.0, 0.0
    x = torch.randn(rows, 5, generator=g)
    indices = torch.full((rows,), slot)
    shrunk, out, sliced = torch.full((rows, 2), 7.0), torch.ones(rows, 4), torch.ones(rows, 6)
    bgmv_shrink(x, a, shrunk, indices, scaling=0.5)
    bgmv_expand(shrunk, b, out, indices, add_inputs=True)
    bgmv_expand_slice(shrunk, b, sliced, indices, 2, 4, add_inputs=True)
    for row in range(rows):
        h = torch.zeros(2) if slot < 0 else 0.5 * a[slot, 0] @ x[row]
        delta = torch.zeros(4) if slot < 0 else b[slot, 0] @ h
        torch.testing.assert_close(shrunk[row], h)
        torch.testing.assert_close(out[row], 1 + delta)
        torch.testing.assert_close(sliced[row], torch.cat([torch.ones(2), 1 + delta]))
    replaced = torch.full((rows, 4), 9.0)
    bgmv_expand(shrunk, b, replaced, indices, add_inputs=False)  # no add: the columns are the delta, zeros included
    torch.testing.assert_close(replaced, torch.stack([b[slot, 0] @ shrunk[r] if slot >= 0 else torch.zeros(4)
                                                      for r in range(rows)]))


@pytest.mark.parametrize(("rows", "dtype"), [(8, torch.float32), (64, torch.bfloat16)])
def test_cpu_lora_ops_multiply_decode_batches_in_float32_and_larger_ones_in_the_outputs_dtype(rows, dtype):
    """bfloat16 activations and adapters: a decode-sized batch's products come back in float32 (as exact as the
    inputs allow), a prefill's in bfloat16, both within bfloat16's rounding of the float32 product."""
    from services.generator.vllm_cpu_lora import per_adapter

    g = torch.Generator().manual_seed(2)
    weights = torch.randn(2, 1, 16, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    product = per_adapter(x, weights, torch.full((rows,), 1), torch.bfloat16)
    assert product is not None and product.dtype == dtype
    exact = x.float() @ weights[1, 0].float().T
    torch.testing.assert_close(product.float(), exact, rtol=1.6e-2, atol=1e-2)
    if dtype == torch.float32:
        torch.testing.assert_close(product, exact)


@pytest.mark.parametrize(("ids", "prefill", "dtype"), [
    ((7,) * 8, False, torch.float32),  # a decode step of one LoRA run: one group over all rows
    ((7, 0, 5, 7, 9, 0, 5, 7), False, torch.float32),  # mixed: three adapters, base rows (no delta), last slot used
    ((5,) * 20 + (0,) * 10 + (7,) * 10, True, torch.bfloat16),  # a prefill of three requests, in bfloat16
])
def test_the_grouped_punica_wrapper_applies_each_tokens_adapter_through_vllms_own_metadata(ids, prefill, dtype):
    """vLLM's real CPU wrapper, changed in place as a worker's is at start, given vLLM's own mapping: every token gets
    scale * B A x of its adapter (its LoRA id's slot), a token of the base model (id 0) none, also while another
    adapter holds the last slot (vLLM's own ops read -1 as that slot)."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from services.generator.vllm_cpu_lora import SlotGroupedLinear, group_rows_per_forward

    wrapper = PunicaWrapperCPU(64, 8, "cpu")
    assert group_rows_per_forward([wrapper, object()]) == 1 and isinstance(wrapper, SlotGroupedLinear)
    assert group_rows_per_forward([wrapper]) == 0
    slots = [5, None, 7, 9]  # lora_index_to_id: adapter id per slot
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=prefill), slots, max_loras=4, vocab_size=32)
    g = torch.Generator().manual_seed(3)
    sizes, rank, d_in = (6, 3, 3), 2, 5  # q, k, v output slices of a merged projection
    a = tuple(torch.randn(4, 1, rank, d_in, generator=g).to(dtype) for _ in sizes)
    b = tuple(torch.randn(4, 1, size, rank, generator=g).to(dtype) for size in sizes)
    x = torch.randn(len(ids), d_in, generator=g).to(dtype)
    y = torch.ones(len(ids), sum(sizes), dtype=dtype)
    wrapper.add_lora_linear(y, x, a, b, 0.5, sizes)
    for row, lora_id in enumerate(ids):
        if lora_id == 0:
            torch.testing.assert_close(y[row], torch.ones(sum(sizes), dtype=dtype))
            continue
        slot = slots.index(lora_id)
        delta = torch.cat([0.5 * b[i][slot, 0].float() @ (a[i][slot, 0].float() @ x[row].float())
                           for i in range(len(sizes))])
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(y[row].float(), 1 + delta, **tolerance)


def test_the_grouped_wrapper_keeps_offsets_replacement_and_falls_back_for_other_row_counts():
    """``add_expand`` from ``offset_start`` with ``add_inputs`` False writes the deltas there (zeros on base rows) and
    leaves the columns before it; a call whose rows are not the forward's tokens takes the wrapper's own path and
    gives the same numbers."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from services.generator.vllm_cpu_lora import group_rows_per_forward, patch_cpu_lora_ops

    patch_cpu_lora_ops()  # the wrapper's own path as a worker runs it
    wrapper = PunicaWrapperCPU(64, 8, "cpu")
    group_rows_per_forward([wrapper])
    ids, slots = (7, 0, 7, 5), [5, None, 7, None]
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=False), slots, max_loras=4, vocab_size=32)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(4, 1, 2, 5, generator=g), torch.randn(4, 1, 3, 2, generator=g)
    h = torch.randn(4, 2, generator=g)
    y = torch.full((4, 6), 9.0)
    wrapper.add_expand(y, (h,), (b,), (3,), offset_start=2, add_inputs=False)
    for row, lora_id in enumerate(ids):
        delta = torch.zeros(3) if lora_id == 0 else b[slots.index(lora_id), 0] @ h[row]
        torch.testing.assert_close(y[row], torch.cat([torch.full((2,), 9.0), delta, torch.full((1,), 9.0)]))
    x = torch.randn(6, 5, generator=g)  # 6 rows against the mapping's 4: vLLM's path (rows past the mapping: none)
    shrunk = torch.full((6, 2), 7.0)
    wrapper.add_shrink((shrunk,), x, (a,), 0.5)
    for row in range(6):
        lora_id = ids[row] if row < 4 else 0
        expected = torch.zeros(2) if lora_id == 0 else 0.5 * a[slots.index(lora_id), 0] @ x[row]
        torch.testing.assert_close(shrunk[row], expected)

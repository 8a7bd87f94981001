"""A staged update read back whole (one read of its data file), and a blob's digest known before it is written."""

from __future__ import annotations

import zlib

import torch

from services.common.weights import ReceivedUpdate, WeightsBlobs, WeightStager, blob_digest, tensor_entries
from services.common.weights.staging import update_tensors


def _staged(tensors: dict[str, torch.Tensor], root) -> ReceivedUpdate:
    stager = WeightStager(root)
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        stager.add(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data, zlib.crc32(data))
    return ReceivedUpdate("policy", "staged", str(stager.folder), stager.finish())


def test_a_staged_update_read_whole_equals_its_entries_read_one_by_one_at_any_alignment(tmp_path):
    # a bf16 tensor of 3 values leaves the next float32 tensor at an offset of 6 bytes: not a float32 boundary
    tensors = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2, 5), "c": torch.randn(4).half(),
               "d": torch.randn(1, 3, dtype=torch.float64), "e": torch.empty(0, 2)}
    update = _staged(tensors, tmp_path)
    whole = update_tensors(update)
    assert list(whole) == list(tensors) == [entry.name for entry in update.entries]  # in order
    for entry in update.entries:
        assert whole[entry.name].dtype == tensors[entry.name].dtype
        assert torch.equal(whole[entry.name], tensors[entry.name]) and torch.equal(whole[entry.name], entry.load())


def test_an_update_of_empty_tensors_only_reads_back(tmp_path):
    update = _staged({"a": torch.empty(0, 3), "b": torch.empty(2, 0, dtype=torch.bfloat16)}, tmp_path)
    whole = update_tensors(update)
    assert [(t.shape, t.dtype) for t in whole.values()] == [((0, 3), torch.float32), ((2, 0), torch.bfloat16)]


def test_a_blobs_digest_is_known_before_it_is_written_and_is_the_one_it_is_written_under(tmp_path):
    tensors = {"lora_A": torch.randn(16, 64), "lora_B": torch.randn(64, 16).to(torch.bfloat16)}
    digest = blob_digest(tensor_entries(tensors))
    blobs = WeightsBlobs(tmp_path / "blobs")
    assert not blobs.path(digest).exists()
    assert blobs.put(tensor_entries(tensors)) == digest
    assert {e.name: e.load() for e in blobs.open(digest)}.keys() == tensors.keys()
    changed = {**tensors, "lora_A": tensors["lora_A"] + 1}
    assert blob_digest(tensor_entries(changed)) != digest

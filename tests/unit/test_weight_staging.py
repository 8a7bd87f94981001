"""A staged update read back whole (one read of its data file), and a blob's digest known before it is written
(from its tensors, or from the bytes hashed as they were staged)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.weights import ReceivedUpdate, WeightsBlobs, WeightStager, blob_digest, tensor_entries
from services.common.weights.records import DATA_FILE, MANIFEST
from services.common.weights.staging import update_tensors


def _staged(tensors: dict[str, torch.Tensor], root, hash_data: bool = False, in_memory: bool = False) -> ReceivedUpdate:
    stager = WeightStager(root, hash_data, in_memory)
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        stager.add(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data, zlib.crc32(data))
    return ReceivedUpdate("policy", stager.kind, str(stager.folder or ""), stager.finish(),
                          data_sha256=stager.data_sha256, values_checked=stager.values_checked)


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_staged_update_read_whole_equals_its_entries_read_one_by_one_at_any_alignment(tmp_path, in_memory):
    # a bf16 tensor of 3 values leaves the next float32 tensor at an offset of 6 bytes: not a float32 boundary
    tensors = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2, 5), "c": torch.randn(4).half(),
               "d": torch.randn(1, 3, dtype=torch.float64), "e": torch.empty(0, 2)}
    update = _staged(tensors, tmp_path, in_memory=in_memory)
    assert update.kind == ("memory" if in_memory else "staged")
    assert list(tmp_path.iterdir()) == ([] if in_memory else [Path(update.folder)])  # in memory: nothing on disk
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


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_digest_from_the_bytes_hashed_as_staged_is_the_blobs_and_a_blob_put_with_it_is_the_same(tmp_path, in_memory):
    # an adapter update's bytes are hashed as they arrive: its blob's digest is then the manifest's work alone, and
    # the blob written with that digest given (its data not hashed again) is byte for byte the one written without
    tensors = {"a": torch.randn(3).to(torch.bfloat16), "lora_A": torch.randn(16, 64), "lora_B": torch.randn(64, 16)}
    update = _staged(tensors, tmp_path, hash_data=True, in_memory=in_memory)
    assert _staged(tensors, tmp_path).data_sha256 is None  # hashed only when asked
    entries = tensor_entries(update_tensors(update))
    digest = blob_digest(entries, update.data_sha256)
    assert digest == blob_digest(entries) == blob_digest(tensor_entries(tensors))
    given, computed = WeightsBlobs(tmp_path / "given"), WeightsBlobs(tmp_path / "computed")
    assert given.put(entries, digest) == computed.put(entries) == digest
    for file in (DATA_FILE, MANIFEST):
        assert (given.path(digest) / file).read_bytes() == (computed.path(digest) / file).read_bytes()
    changed = {**tensors, "lora_B": tensors["lora_B"] + 1}
    assert blob_digest(entries, _staged(changed, tmp_path, hash_data=True).data_sha256) != digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_update_in_memory_refuses_a_tensor_with_nan_or_infinity_naming_it_as_it_arrives(tmp_path, dtype):
    # a bf16 tensor of 3 values first: the next one starts off its dtype's alignment
    good = {"a": torch.randn(3).to(torch.bfloat16), "b": torch.randn(2, 5).to(dtype)}
    assert _staged(good, tmp_path, in_memory=True).values_checked
    assert not _staged(good, tmp_path).values_checked  # on disk: the receiver's caller scans
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensors = {**good, "b": good["b"].clone(), "c": torch.randn(4)}
        tensors["b"][1, 3] = bad
        stager = WeightStager(tmp_path, in_memory=True)
        with pytest.raises(InvalidRequest, match="holds NaN or infinite values") as refused:
            for name, tensor in tensors.items():
                data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
                stager.add(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data,
                           zlib.crc32(data))
        assert refused.value.field == "tensors[b]" and name == "c"  # refused as c began, before its bytes

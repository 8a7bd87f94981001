"""Staging: streamed tensors written to disk, checkpoint folders read lazily, tensors copied into a model.

An update is a list of :class:`TensorEntry` (name, dtype, shape, and a loader that reads the tensor when the
engine applies it), so memory on the receiving side stays bounded by one tensor: streamed chunks are appended to
one data file in a staging folder, each tensor at its offset (a ``manifest.json`` lists them; vLLM's worker
processes read it too: one file, not one per tensor, since creating hundreds of files for a LoRA adapter's small
tensors cost more than writing them), and a
checkpoint folder's safetensors files are opened lazily. :func:`~services.common.weights.checks.check_update` rejects the update as a whole,
before anything is applied, naming the first bad tensor.

Shared by the generator and the experience service (which checks a policy update against its actor replica,
forwards it to the generator with :func:`weight_chunks`, and copies it into the replica with :func:`copy_into`).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch

from fastexp.types import FLOAT_DTYPES
from services.common.errors import InvalidRequest
from services.common.weights.checks import all_finite, check_entry, max_update_bytes
from services.common.weights.records import (
    DATA_FILE,
    MANIFEST,
    ReceivedUpdate,
    TensorEntry,
    TensorSpec,
    UpdateKind,
)

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def model_spec(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Checkpoint names, shapes and dtypes of the model folder's safetensors files (headers only, no weights).

    With ``tie_word_embeddings`` the output projection is the input embedding: ``lm_head.weight`` (which a
    trainer's ``state_dict()`` contains) is accepted as another name of ``model.embed_tokens.weight``.
    """
    try:
        spec = {entry.name: TensorSpec(entry.shape, entry.dtype) for entry in checkpoint_entries(model_dir)}
    except InvalidRequest:  # not a folder with safetensors files (e.g. a hub id): nothing to check against
        return {}
    config_file = Path(model_dir) / "config.json"
    tied = config_file.is_file() and json.loads(config_file.read_text()).get("tie_word_embeddings", False)
    if tied and "model.embed_tokens.weight" in spec:
        spec.setdefault("lm_head.weight", spec["model.embed_tokens.weight"])
    return spec


def checkpoint_entries(folder: str | Path) -> list[TensorEntry]:
    """The tensors of every ``*.safetensors`` file in ``folder``, read lazily.

    Raises:
        InvalidRequest: ``checkpoint_dir``: the folder does not exist or holds no safetensors file.
    """
    from safetensors import safe_open

    path = Path(folder)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise InvalidRequest("checkpoint_dir", f"{str(folder)!r} is not a folder with *.safetensors files")
    entries = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                sliced = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sliced.get_dtype(), sliced.get_dtype())

                def load(file: Path = file, name: str = name) -> torch.Tensor:
                    with safe_open(str(file), framework="pt") as h:
                        return h.get_tensor(name)

                entries.append(TensorEntry(name, dtype, tuple(sliced.get_shape()), load))
    return entries


class WeightStager:
    """Receives a streamed update chunk by chunk into a staging folder (one data file, tensors at their offsets).

    Call :meth:`expect` with the model's spec once the target is known, :meth:`add` per chunk, then
    :meth:`finish`; :meth:`discard` removes the folder (always call it, e.g. in ``finally``). Memory held: one
    chunk (on disk; in memory, see below). Each tensor's first chunk must carry its CRC-32, checked once its last
    byte arrived; with a spec, that first chunk is checked against the model (:func:`check_entry`) before anything of it is written, and the
    update's bytes are capped at :func:`max_update_bytes`. ``hash_data``: also hash the bytes as they arrive
    (:attr:`data_sha256`, the data half of the digest its blob gets:
    :func:`~services.common.weights.blobs.blob_digest`). ``in_memory``: the data is held in memory instead, its
    tensors views of it (:attr:`kind` ``"memory"``; no folder), and each tensor's values are scanned for NaN and
    infinity once its CRC-32 checks out, while the next ones are on their way (:attr:`values_checked`): for an
    update read whole anyway and bounded by a small spec, a LoRA adapter's (staging a rank-16 adapter's 420 tensors
    on disk and reading them back took 3x as long as receiving them in memory here).
    """

    def __init__(self, root: str | Path | None = None, hash_data: bool = False, in_memory: bool = False) -> None:
        self.folder = None if in_memory else Path(tempfile.mkdtemp(prefix="fastexp-weights-", dir=root))
        self._sha256 = hashlib.sha256() if hash_data else None
        self._file = None  # the data file, opened with the first tensor that checks out
        self._buffer = bytearray() if in_memory else None  # the data, in memory
        self._tensors: list[dict] = []
        self._names: set[str] = set()  # every tensor started: a name sent again is found in O(1)
        self._spec: Mapping[str, TensorSpec] | None = None
        self._max_bytes: int | None = None
        self._total = 0  # bytes received, all tensors
        self._written = 0
        self._crc32 = 0  # running CRC-32 of the current tensor's bytes
        self._expected_crc32: int | None = None  # the sender's, from the tensor's first chunk

    def expect(self, spec: Mapping[str, TensorSpec]) -> None:
        """Check every tensor's first chunk against ``spec`` and cap the update at the model's size."""
        self._spec = spec
        self._max_bytes = max_update_bytes(spec)

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: bytes, crc32: int | None = None) -> None:
        """Append ``data`` to tensor ``name`` (a new name starts the next tensor); ``crc32``: the sender's
        CRC-32 of the whole tensor, required on its first chunk, checked when the tensor is complete.

        Raises:
            InvalidRequest: naming the tensor: a first chunk without ``crc32`` or failing :func:`check_entry`,
                unknown dtype, a chunk disagreeing with its tensor's dtype/shape, a tensor sent again after
                another started, more bytes than its shape holds or than the model's size, or (when the tensor
                ends) a CRC-32 mismatch.
        """
        field = f"tensors[{name}]"
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(field, f"dtype {dtype} is not a floating-point type")
        current = self._tensors[-1] if self._tensors else None
        if current is None or current["name"] != name:
            current = self._start(name, dtype, shape, crc32)
        elif current["dtype"] != dtype or current["shape"] != list(shape):
            raise InvalidRequest(field, "dtype and shape must be the same on every chunk")
        expected = math.prod(shape) * FLOAT_DTYPES[dtype].itemsize
        if self._written + len(data) > expected:
            raise InvalidRequest(field, f"more than the {expected} bytes its shape {list(shape)} holds")
        self._total += len(data)
        if self._max_bytes is not None and self._total > self._max_bytes:
            raise InvalidRequest(field, f"the update passes {self._max_bytes} bytes, the model's size")
        if self._buffer is not None:
            self._buffer += data
        else:
            self._file.write(data)
        self._written += len(data)
        self._crc32 = zlib.crc32(data, self._crc32)
        if self._sha256 is not None:
            self._sha256.update(data)

    @property
    def data_sha256(self) -> str | None:
        """The hex SHA-256 of every byte staged so far, tensors in order (None: made without ``hash_data``)."""
        return None if self._sha256 is None else self._sha256.hexdigest()

    def _start(self, name: str, dtype: str, shape: tuple[int, ...], crc32: int | None) -> dict:
        """Close the current tensor and open ``name``'s file, once its first chunk checks out."""
        self._close_current()
        field = f"tensors[{name}]"
        if name in self._names:
            raise InvalidRequest(field, "sent twice (chunks of a tensor must be consecutive)")
        if crc32 is None:
            raise InvalidRequest(field, "the first chunk must carry crc32, the CRC-32 (zlib.crc32) of the tensor's bytes")
        if self._spec is not None:
            check_entry(name, dtype, shape, self._spec)
        current = {"name": name, "dtype": dtype, "shape": list(shape), "offset": self._total}
        if self._file is None and self._buffer is None:
            self._file = open(self.folder / DATA_FILE, "wb")  # noqa: SIM115 - closed in finish() or discard()
        self._tensors.append(current)
        self._names.add(name)
        self._written = 0
        self._crc32 = 0
        self._expected_crc32 = crc32
        return current

    def _close_current(self) -> None:
        if not self._tensors:
            return
        current = self._tensors[-1]
        expected = math.prod(current["shape"]) * FLOAT_DTYPES[current["dtype"]].itemsize
        field = f"tensors[{current['name']}]"
        if self._written != expected:
            raise InvalidRequest(field, f"{self._written} of {expected} bytes arrived")
        if self._crc32 != self._expected_crc32:
            raise InvalidRequest(
                field, f"CRC-32 {self._crc32:#010x} of the received bytes != the sender's {self._expected_crc32:#010x} "
                "(corrupted in transit); nothing was applied",
            )
        if self._buffer is not None and expected and not _finite_at(self._buffer, current):
            raise InvalidRequest(field, "holds NaN or infinite values")

    def finish(self, num_tensors: int | None = None) -> list[TensorEntry]:
        """Close the last tensor, write the manifest, and return the staged tensors.

        Raises:
            InvalidRequest: the last tensor is incomplete, or ``num_tensors`` differs from what arrived.
        """
        self._close_current()
        if num_tensors is not None and num_tensors != len(self._tensors):
            raise InvalidRequest("header.num_tensors", f"{num_tensors} announced, {len(self._tensors)} arrived")
        if self._buffer is not None:
            return _memory_entries(self._buffer, self._tensors)
        if self._file is not None:
            self._file.close()
        (self.folder / MANIFEST).write_text(json.dumps(self._tensors))
        return staged_entries(self.folder)

    @property
    def values_checked(self) -> bool:
        """Whether every tensor's values were scanned for NaN and infinity as it arrived (in memory)."""
        return self._buffer is not None

    @property
    def kind(self) -> UpdateKind:
        """``"staged"`` (a folder on disk) or ``"memory"``."""
        return "staged" if self._buffer is None else "memory"

    def discard(self) -> None:
        """Remove the staging folder (in memory: nothing to remove; the tensors keep the data alive)."""
        if self._file is not None:
            self._file.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _finite_at(data: bytearray, tensor: dict) -> bool:
    """Whether ``tensor``'s bytes in ``data`` (manifest row: dtype, shape, offset) hold no NaN and no infinity."""
    return all_finite(_view(data, tensor))


def _view(data: bytearray, tensor: dict) -> torch.Tensor:
    """``tensor``'s bytes in ``data`` as a tensor of its dtype and shape: a view (a copy where the offset is not
    aligned to its dtype). Made through numpy, whose view holds ``data``'s buffer: while one lives, growing ``data``
    raises BufferError instead of moving the bytes under it."""
    dtype, shape, offset = FLOAT_DTYPES[tensor["dtype"]], tuple(tensor["shape"]), tensor["offset"]
    count = math.prod(shape) * dtype.itemsize
    if not count:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=count, offset=offset))
    return (raw if offset % dtype.itemsize == 0 else raw.clone()).view(dtype).reshape(shape)


def _memory_entries(data: bytearray, tensors: list[dict]) -> list[TensorEntry]:
    """The entries of an update held in memory, each :func:`_view` of ``data`` at its offset."""
    views = [(tensor, _view(data, tensor)) for tensor in tensors]
    return [TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), lambda view=view: view) for t, view in views]


def staged_entries(folder: str | Path) -> list[TensorEntry]:
    """The tensors a :class:`WeightStager` wrote to ``folder`` (read lazily; usable in another process)."""
    folder = Path(folder)
    entries = []
    for tensor in json.loads((folder / MANIFEST).read_text()):
        dtype, shape, offset = tensor["dtype"], tuple(tensor["shape"]), tensor["offset"]

        def load(dtype: str = dtype, shape: tuple = shape, offset: int = offset) -> torch.Tensor:
            count = math.prod(shape) * FLOAT_DTYPES[dtype].itemsize
            if not count:  # numpy gives an empty read a stride torch cannot view
                return torch.empty(shape, dtype=FLOAT_DTYPES[dtype])
            raw = np.fromfile(folder / DATA_FILE, dtype=np.uint8, count=count, offset=offset)
            return torch.from_numpy(raw).view(FLOAT_DTYPES[dtype]).reshape(shape)

        entries.append(TensorEntry(tensor["name"], dtype, shape, load))
    return entries


def update_tensors(update: ReceivedUpdate) -> dict[str, torch.Tensor]:
    """A received update's tensors in memory, by name, in order (for updates small enough to hold whole, such as an
    adapter's): one received in memory (kind ``"memory"``) as its views; a staged one from a single read of its data
    file, each tensor a view of that buffer where its
    offset is aligned to its dtype (a copy where not); a checkpoint's read one by one."""
    if update.kind != "staged":
        return {entry.name: entry.load() for entry in update.entries}
    manifest = json.loads((Path(update.folder) / MANIFEST).read_text())
    data = torch.from_numpy(np.fromfile(Path(update.folder) / DATA_FILE, dtype=np.uint8)) if manifest else None
    tensors = {}
    for tensor in manifest:
        dtype, shape, offset = FLOAT_DTYPES[tensor["dtype"]], tuple(tensor["shape"]), tensor["offset"]
        count = math.prod(shape) * dtype.itemsize
        if not count:  # an empty read's stride cannot be viewed as another dtype
            tensors[tensor["name"]] = torch.empty(shape, dtype=dtype)
            continue
        raw = data[offset : offset + count]
        if len(raw) != count:
            raise ValueError(f"{update.folder}: {tensor['name']} is cut short ({len(raw)} of {count} bytes)")
        tensors[tensor["name"]] = (raw if offset % dtype.itemsize == 0 else raw.clone()).view(dtype).reshape(shape)
    return tensors


def update_entries(kind: str, folder: str) -> list[TensorEntry]:
    """Entries of an update by kind: ``"staged"`` (a :class:`WeightStager` folder) or ``"checkpoint"``."""
    return staged_entries(folder) if kind == "staged" else checkpoint_entries(folder)


def module_spec(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The spec of live tensors by checkpoint name (e.g. ``model.state_dict(keep_vars=True)``)."""
    return {name: TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


def tensor_entries(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """A model's live tensors as update entries (each read when loaded: hold whatever lock keeps them still)."""
    return [TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), lambda t=t: t.detach().cpu())
            for name, t in tensors.items()]


def copy_into(targets: Mapping[str, torch.Tensor], entries: Iterable[TensorEntry]) -> None:
    """Copy each entry into the live tensor of its name, in place (cast to the tensor's dtype and device).

    Tied tensors (``lm_head.weight`` / ``model.embed_tokens.weight``) are one storage, so updating either
    updates both, as in the checkpoint. The caller holds whatever lock keeps forwards off the model and has
    checked the entries (:func:`check_update`), so this cannot fail half-way on a bad name or shape.
    """
    with torch.no_grad():
        for entry in entries:
            targets[entry.name].data.copy_(entry.load())

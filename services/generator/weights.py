"""Weight updates: stage streamed tensors on disk, read checkpoint folders lazily, check both against the model.

An update is a list of :class:`TensorEntry` (name, dtype, shape, and a loader that reads the tensor when the
engine applies it), so memory on the receiving side stays bounded by one tensor: streamed chunks are appended to
one file per tensor in a staging folder (with a ``manifest.json`` that vLLM's worker processes read too), and a
checkpoint folder's safetensors files are opened lazily. :func:`check_update` rejects the update as a whole,
before anything is applied, naming the first bad tensor.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.errors import InvalidRequest

MANIFEST = "manifest.json"

#: Wire dtype name -> torch dtype; only floating-point tensors are weights.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an update; ``load()`` reads it (CPU, ``dtype``, ``shape``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data: prod(shape) * itemsize(dtype)."""
        return math.prod(self.shape) * FLOAT_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class TensorSpec:
    """What the model expects under a checkpoint name."""

    shape: tuple[int, ...]
    dtype: str


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


def check_update(entries: list[TensorEntry], spec: Mapping[str, TensorSpec]) -> None:
    """Reject the update unless every tensor names a model tensor with its shape and a floating dtype.

    Raises:
        InvalidRequest: naming the tensor (``tensors[<name>]``): unknown name, wrong shape, non-float dtype, or a
            name sent twice; or ``tensors`` when the update is empty.
    """
    if not entries:
        raise InvalidRequest("tensors", "an update needs at least one tensor")
    seen = set()
    for entry in entries:
        field = f"tensors[{entry.name}]"
        if entry.name in seen:
            raise InvalidRequest(field, "sent twice")
        seen.add(entry.name)
        if entry.name not in spec:
            raise InvalidRequest(field, "the model has no tensor of that name")
        if entry.dtype not in FLOAT_DTYPES:
            raise InvalidRequest(field, f"dtype {entry.dtype} is not a floating-point type")
        if entry.shape != spec[entry.name].shape:
            raise InvalidRequest(field, f"shape {list(entry.shape)} != the model's {list(spec[entry.name].shape)}")


class WeightStager:
    """Receives a streamed update chunk by chunk into a staging folder (one raw file per tensor).

    Call :meth:`add` per chunk, then :meth:`finish`; :meth:`discard` removes the folder (always call it, e.g. in
    ``finally``). Memory held: one chunk.
    """

    def __init__(self, root: str | Path | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="fastexp-weights-", dir=root))
        self._tensors: list[dict] = []
        self._file = None
        self._written = 0

    def add(self, name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
        """Append ``data`` to tensor ``name`` (a new name starts the next tensor).

        Raises:
            InvalidRequest: unknown dtype, a chunk disagreeing with its tensor's dtype/shape, a tensor sent again
                after another started, or more bytes than its shape holds.
        """
        field = f"tensors[{name}]"
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(field, f"dtype {dtype} is not a floating-point type")
        current = self._tensors[-1] if self._tensors else None
        if current is None or current["name"] != name:
            self._close_current()
            if any(t["name"] == name for t in self._tensors):
                raise InvalidRequest(field, "chunks of a tensor must be consecutive")
            file = f"{len(self._tensors):06d}.bin"
            current = {"name": name, "dtype": dtype, "shape": list(shape), "file": file}
            self._tensors.append(current)
            self._file = open(self.folder / file, "wb")  # noqa: SIM115 - closed in _close_current
            self._written = 0
        elif current["dtype"] != dtype or current["shape"] != list(shape):
            raise InvalidRequest(field, "dtype and shape must be the same on every chunk")
        expected = math.prod(shape) * FLOAT_DTYPES[dtype].itemsize
        if self._written + len(data) > expected:
            raise InvalidRequest(field, f"more than the {expected} bytes its shape {list(shape)} holds")
        self._file.write(data)
        self._written += len(data)

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        current = self._tensors[-1]
        expected = math.prod(current["shape"]) * FLOAT_DTYPES[current["dtype"]].itemsize
        if self._written != expected:
            raise InvalidRequest(f"tensors[{current['name']}]", f"{self._written} of {expected} bytes arrived")

    def finish(self, num_tensors: int | None = None) -> list[TensorEntry]:
        """Close the last tensor, write the manifest, and return the staged tensors.

        Raises:
            InvalidRequest: the last tensor is incomplete, or ``num_tensors`` differs from what arrived.
        """
        self._close_current()
        if num_tensors is not None and num_tensors != len(self._tensors):
            raise InvalidRequest("header.num_tensors", f"{num_tensors} announced, {len(self._tensors)} arrived")
        (self.folder / MANIFEST).write_text(json.dumps(self._tensors))
        return staged_entries(self.folder)

    def discard(self) -> None:
        """Remove the staging folder."""
        if self._file is not None:
            self._file.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def staged_entries(folder: str | Path) -> list[TensorEntry]:
    """The tensors a :class:`WeightStager` wrote to ``folder`` (read lazily; usable in another process)."""
    folder = Path(folder)
    entries = []
    for tensor in json.loads((folder / MANIFEST).read_text()):
        dtype, shape = tensor["dtype"], tuple(tensor["shape"])

        def load(path: Path = folder / tensor["file"], dtype: str = dtype, shape: tuple = shape) -> torch.Tensor:
            raw = np.fromfile(path, dtype=np.uint8)
            return torch.from_numpy(raw).view(FLOAT_DTYPES[dtype]).reshape(shape)

        entries.append(TensorEntry(tensor["name"], dtype, shape, load))
    return entries


def update_entries(kind: str, folder: str) -> list[TensorEntry]:
    """Entries of an update by kind: ``"staged"`` (a :class:`WeightStager` folder) or ``"checkpoint"``."""
    return staged_entries(folder) if kind == "staged" else checkpoint_entries(folder)

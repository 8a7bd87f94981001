"""The records an update is made of, free of torch's loaders' details and of protobuf: what the model expects
under a name (:class:`TensorSpec`), one tensor of an update (:class:`TensorEntry`), an update as received
(:class:`ReceivedUpdate`) and what a receiving service checks it against (:class:`UpdateBounds`); the staging
format's two file names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fastexp.types import FLOAT_DTYPES, Target

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
#: The staging folder's one data file: every tensor's bytes, one after the other (offsets in the manifest).
DATA_FILE = "tensors.bin"

UpdateKind = Literal["staged", "checkpoint", "memory"]


@dataclass(frozen=True)
class TensorSpec:
    """What the model expects under a checkpoint name."""

    shape: tuple[int, ...]
    dtype: str


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
class ReceivedUpdate:
    """An ``UpdateWeights`` stream, read: where its tensors are and what they replace."""

    target: Target
    kind: UpdateKind
    folder: str  # the staging folder (``staged``), the named checkpoint folder (``checkpoint``); "" (``memory``)
    entries: list[TensorEntry]
    policy_version: int | None = None  # the version the sender asked for (None: previous + 1)
    # the hex SHA-256 of the entries' bytes in order, hashed as they arrived (None: not hashed): their blob's data
    data_sha256: str | None = None
    values_checked: bool = False  # every tensor's values scanned for NaN and infinity as it arrived

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data in the update."""
        return sum(entry.num_bytes for entry in self.entries)


@dataclass(frozen=True)
class UpdateBounds:
    """What a receiving service checks an ``UpdateWeights`` stream against: ``spec_for(target)``, the model's
    tensors for a target (raises InvalidRequest naming ``header.target`` for one it does not serve), and the
    folders a ``checkpoint_dir`` may be under (none: checkpoint updates are refused)."""

    spec_for: Callable[[Target], Mapping[str, TensorSpec]]
    checkpoint_roots: tuple[Path, ...] = ()

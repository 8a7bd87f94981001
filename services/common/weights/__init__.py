"""Weights from the trainer to every replica, in one package: an update is received, staged, checked, kept once
by reference, and loaded wherever a replica lags.

The path of an ``UpdateWeights`` stream, each step in one module:

1. :mod:`~services.common.weights.wire` reads the stream (servicers only: the one module here that knows
   protobuf) into a :class:`~services.common.weights.records.ReceivedUpdate`, re-sends one to a generator, and
   sends an adapter with ``LoadAdapter``;
2. :mod:`~services.common.weights.staging` writes its chunks to one data file (memory bounded by one tensor) or
   opens a checkpoint folder lazily, checking each tensor on its first chunk with
3. :mod:`~services.common.weights.checks` (pure: names, dtypes, shapes, total bytes, where a checkpoint may be);
4. :mod:`~services.common.weights.blobs` keeps each version's tensors once, content-addressed and checksummed, on
   a volume every replica mounts; any replica loads the live version from there
   (:class:`~services.common.weights.staging.copy_into` into a model, or re-sent to a generator).

:mod:`~services.common.weights.records` holds the records every step passes on (no torch loaders' details, no
protobuf). Imports go one way: records ← checks ← staging ← blobs, wire.
"""

from services.common.weights.blobs import WeightsBlobs, blob_digest
from services.common.weights.checks import (
    accepts_dtype,
    allowed_checkpoint_dir,
    check_complete,
    check_entry,
    check_update,
    max_update_bytes,
)
from services.common.weights.records import (
    DATA_FILE,
    MANIFEST,
    ReceivedUpdate,
    TensorEntry,
    TensorSpec,
    UpdateBounds,
    UpdateKind,
)
from services.common.weights.staging import (
    WeightStager,
    checkpoint_entries,
    copy_into,
    model_spec,
    module_spec,
    staged_entries,
    tensor_entries,
    update_entries,
)

__all__ = [
    "DATA_FILE", "MANIFEST", "ReceivedUpdate", "TensorEntry", "TensorSpec", "UpdateBounds", "UpdateKind",
    "WeightStager", "WeightsBlobs", "accepts_dtype", "blob_digest", "allowed_checkpoint_dir", "check_complete", "check_entry",
    "check_update", "checkpoint_entries", "copy_into", "max_update_bytes", "model_spec", "module_spec",
    "staged_entries", "tensor_entries", "update_entries",
]

"""Weights by reference: each version's tensors (full policy weights, a LoRA run's adapter, the critic) written
once into a content-addressed folder of blobs, its name the SHA-256 of its bytes, the way OCI registries and git
keep large objects. The state store's rows hold the digest (``sha256:<hex>``); any experience replica, and any
generator replica it brings up to date, loads the live version from here, never from another process's memory.

A blob is a folder in the staging format (:mod:`~services.common.weights.staging`: ``manifest.json`` listing each tensor's
name, dtype, shape and offset, and one data file ``tensors.bin``), so its tensors are read lazily, one at a time.
The digest is the SHA-256 of the manifest's bytes, a newline, and the hex SHA-256 of the data file. A blob is written to a
temporary folder beside the others and renamed into place (atomic on one filesystem: a reader never sees half of
one); two replicas writing the same bytes end with one blob. Readers verify the digest before loading
(:meth:`WeightsBlobs.open`).

The folder is a directory on a volume every experience replica mounts (Compose: a named volume; Kubernetes: a
ReadWriteMany claim). :meth:`WeightsBlobs.collect` removes blobs no live version names, once they are older than a
grace period (a replica may still be loading one a moment ago live).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from services.common import metrics
from services.common.errors import NotReady
from services.common.weights.records import DATA_FILE, MANIFEST, TensorEntry
from services.common.weights.staging import staged_entries

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes hashed and copied at a time


class WeightsBlobs:
    """The blob folder ``root`` (module docs)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, entries: Iterable[TensorEntry], digest: str | None = None) -> str:
        """Write ``entries`` (each tensor loaded once, in order) as a blob; returns its digest ``sha256:<hex>``.
        Writing a blob that exists already leaves the one there. ``digest``: theirs, where the caller computed it
        already (:func:`blob_digest` of these same entries): not computed again.

        Raises:
            OSError: the folder cannot be written (full, read-only).
        """
        temporary = self.root / f".incoming-{uuid.uuid4().hex}"
        temporary.mkdir()
        with metrics.WEIGHTS_BLOB_SECONDS.labels("put").time():
            return self._put(entries, temporary, digest)

    def _put(self, entries: Iterable[TensorEntry], temporary: Path, known: str | None) -> str:
        try:
            with open(temporary / DATA_FILE, "wb") as data:
                manifest_bytes, digest = _encode(entries, data.write, known)
                data.flush()
                os.fsync(data.fileno())
            (temporary / MANIFEST).write_bytes(manifest_bytes)
            target = self.path(digest)
            if target.exists():
                return digest
            try:
                os.rename(temporary, target)
            except OSError:
                if not target.exists():  # not another writer's identical blob: a real failure
                    raise
            return digest
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    def path(self, digest: str) -> Path:
        """The folder of blob ``digest`` (``sha256:<hex>``)."""
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            raise ValueError(f"not a weights digest: {digest!r}")
        return self.root / hexdigest

    def open(self, digest: str) -> list[TensorEntry]:
        """The tensors of blob ``digest``, read lazily, after checking the bytes on disk hash to it.

        Raises:
            NotReady: the blob is missing or its bytes do not match its digest (a volume not shared by this
                replica, or corrupted): naming the blob and the folder.
        """
        with metrics.WEIGHTS_BLOB_SECONDS.labels("open").time():
            return self._open(digest)

    def _open(self, digest: str) -> list[TensorEntry]:
        folder = self.path(digest)
        try:
            manifest_bytes = (folder / MANIFEST).read_bytes()
            data_hash = hashlib.sha256()
            with open(folder / DATA_FILE, "rb") as data:
                while chunk := data.read(_CHUNK):
                    data_hash.update(chunk)
        except FileNotFoundError:
            raise NotReady(f"weights blob {digest} is not in {self.root} (is the weights volume shared by every "
                           "experience replica?)") from None
        found = _digest(manifest_bytes, data_hash.hexdigest())
        if found != digest:
            raise NotReady(f"weights blob {digest} in {self.root} is corrupt: its bytes hash to {found}")
        return staged_entries(folder)

    def collect(self, keep: set[str], grace_s: float = 600.0) -> list[str]:
        """Remove blobs no digest in ``keep`` names, older than ``grace_s`` seconds (and abandoned temporary
        folders); returns the digests removed."""
        removed, cutoff = [], time.time() - grace_s
        kept_names = {self.path(digest).name for digest in keep}
        for folder in self.root.iterdir():
            if folder.name in kept_names or not folder.is_dir() or folder.stat().st_mtime > cutoff:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.name.startswith(".incoming-"):
                removed.append(f"sha256:{folder.name}")
        if removed:
            logger.info("weights blobs collected: %d no live version needs", len(removed))
        return removed


def blob_digest(entries: Iterable[TensorEntry], data_sha256: str | None = None) -> str:
    """The digest :meth:`WeightsBlobs.put` gives ``entries`` (each loaded once, in order), computed without
    writing anything: what names an update's weights on the replicas while its blob is being written.
    ``data_sha256``: the hex SHA-256 of the entries' bytes in order, where it is known already (hashed as they
    arrived: ``ReceivedUpdate.data_sha256``); then no tensor is loaded, only the manifest made."""
    if data_sha256 is None:
        return _encode(entries, None)[1]
    manifest, offset = [], 0
    for entry in entries:
        manifest.append(_manifest_row(entry, offset))
        offset += entry.num_bytes
    return _digest(json.dumps(manifest).encode(), data_sha256)


def _encode(entries: Iterable[TensorEntry], write: Callable[[memoryview], object] | None,
            known: str | None = None) -> tuple[bytes, str]:
    """The blob of ``entries``: its data (each tensor's bytes in order, handed to ``write``), its manifest's bytes
    and its digest (``known``: given, the data not hashed)."""
    manifest, data_hash, offset = [], None if known else hashlib.sha256(), 0
    for entry in entries:
        raw = memoryview(entry.load().contiguous().view(-1).view(dtype=torch.uint8).numpy())
        if write is not None:
            write(raw)
        if data_hash is not None:
            data_hash.update(raw)
        manifest.append(_manifest_row(entry, offset))
        offset += raw.nbytes
    manifest_bytes = json.dumps(manifest).encode()
    return manifest_bytes, known or _digest(manifest_bytes, data_hash.hexdigest())


def _manifest_row(entry: TensorEntry, offset: int) -> dict:
    """A tensor's row of a blob's manifest: where its bytes start in the data file."""
    return {"name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape), "offset": offset}


def _digest(manifest: bytes, data_hexdigest: str) -> str:
    """The blob's digest: SHA-256 over the manifest's bytes and the data's SHA-256."""
    return "sha256:" + hashlib.sha256(manifest + b"\n" + data_hexdigest.encode()).hexdigest()


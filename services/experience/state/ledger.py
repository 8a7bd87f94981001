"""The version ledger in the state store: versions issued by the store's rows (one claim at a time per model or
run, serialized by the row's lock on every replica), each version's weights written by reference first
(:class:`~services.common.weights.blobs.WeightsBlobs`). Implements the pipeline's ``VersionLedger``
(:mod:`services.experience.pipeline.ledger`); its records have the same fields."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence

from services.common.errors import NotReady
from services.common.versions import Claim, Snapshot
from services.common.weights import TensorEntry, WeightsBlobs, blob_digest
from services.experience.state import rows
from services.experience.state.store import StateStore


class StoredLedger:
    """Versions in ``store``, weights in ``blobs``; an update's claim lasts ``claim_s`` seconds (a replica killed
    mid-update holds it no longer: the next update takes it over)."""

    by_reference = True

    def __init__(self, store: StateStore, blobs: WeightsBlobs, claim_s: float = 900.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._blobs = blobs
        self._claim_s = claim_s
        self._clock = clock

    async def claim(self, *, target: str | None = None, run_id: str | None = None) -> Claim:
        now = self._clock()
        return await self._store.transact("claiming a weight update", functools.partial(
            rows.claim_update, now=now, until=now + self._claim_s, target=target, run_id=run_id))

    async def put(self, entries: Sequence[TensorEntry], digest: str | None = None) -> str:
        try:
            return await asyncio.to_thread(self._blobs.put, entries, digest)
        except OSError as error:
            raise NotReady(f"the weights folder {self._blobs.root} cannot be written: {error}") from error

    async def digest(self, entries: Sequence[TensorEntry], data_sha256: str | None = None) -> str:
        if data_sha256 is not None:  # the manifest alone: no tensor is read
            return blob_digest(entries, data_sha256)
        return await asyncio.to_thread(blob_digest, entries)

    async def commit(self, claim: Claim, version: int | None, entries: Sequence[TensorEntry] | None = None, *,
                     digest: str | None = None) -> str | None:
        if version is None:
            digest = None
        elif digest is None and entries is not None:
            digest = await self.put(entries)
        held = await self._store.transact("committing a weight update", functools.partial(
            rows.commit_update, claim=claim, version=version, weights_digest=digest, now=self._clock()))
        if not held and version is not None:
            raise NotReady(f"the claim of this update expired after {self._claim_s:.0f} s and another update took "
                           f"it over: version {version} is not live; send the update again")
        return digest

    async def snapshot(self) -> Snapshot:
        return await self._store.transact("reading live versions", functools.partial(rows.select_live,
                                                                                   now=self._clock()))

    def weights(self, digest: str) -> list[TensorEntry]:
        return self._blobs.open(digest)

    async def collect(self, grace_s: float = 600.0) -> list[str]:
        """Remove the blobs no live version names (older than ``grace_s``): :meth:`WeightsBlobs.collect`."""
        keep = await self._store.transact("listing live weights", rows.digests_in_use)
        return await asyncio.to_thread(self._blobs.collect, keep, grace_s)

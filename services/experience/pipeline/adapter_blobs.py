"""An adapter update's blob written while the generator replicas load the adapter (its digest, computed first,
names it there), and what happens when the blob cannot be written: the replicas, which already serve the new
adapter, are put back on the ledger's live version, so that no replica serves a version the ledger lacks (another
experience replica, or a generator replica restarting, could never load it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import torch

from services.common.deadlines import Deadline
from services.common.errors import NotReady
from services.common.lora import AdapterConfig
from services.common.versions import Live
from services.experience.pipeline.events import Generator
from services.experience.pipeline.ledger import VersionLedger

logger = logging.getLogger(__name__)


async def stored_or_put_back(stored: Awaitable[str | None], digest: str, ledger: VersionLedger, generator: Generator,
                             name: str, config: AdapterConfig, loaded: int, before: Live, deadline: Deadline,
                             held: Callable[[], Awaitable[Mapping[str, torch.Tensor]]] | None = None) -> None:
    """Wait until run ``name``'s new adapter (version ``loaded``, loaded on the generator replicas) is stored as
    ``digest`` (``stored``: :meth:`VersionLedger.put`). Where it was not, the replicas are put back on the ledger's
    live version ``before`` with ``config`` within ``deadline``: its tensors from ``held`` (this replica's copy,
    when it is that version's) or else from its blob (the folder that just failed may still be read); version 0:
    unloaded.

    Raises:
        NotReady: the adapter was not stored (naming why; and why putting a replica back failed, if it did: the
            fleet takes such a replica out and resyncs it before it serves again).
    """
    try:
        written = await stored
        # equal by construction where the digest came from the update's bytes hashed as staged and was given to the
        # write (WeightsBlobs.put); a blob's bytes are checked against its digest whenever it is read (open)
        if written == digest:
            return
        error: BaseException = NotReady(f"its blob was stored as {written}, not {digest}")
    except Exception as failure:  # noqa: BLE001 - whatever it was, the new version must not stay on the replicas
        error = failure
    logger.warning("run %s: adapter version %d not stored (%s): the generator replicas go back to version %d", name,
                   loaded, error, before.version)
    try:
        if before.version and before.weights_digest:
            tensors = await held() if held is not None else await asyncio.to_thread(_blob_tensors, ledger, before)
            await generator.load_adapter(name, config, tensors, before.version, deadline,
                                         weights_digest=before.weights_digest)
        else:
            await generator.unload_adapter(name)
    except Exception as failure:  # noqa: BLE001 - reported with the cause, below
        raise NotReady(f"run {name}'s adapter could not be stored ({error}), and putting the generator replicas back "
                       f"failed ({failure}): they are resynced before they serve again") from error
    raise NotReady(f"run {name}'s adapter could not be stored, so it is not live anywhere: {error}") from error


def _blob_tensors(ledger: VersionLedger, live: Live) -> dict[str, torch.Tensor]:
    """The tensors of ``live``'s blob (verified), in memory."""
    return {entry.name: entry.load() for entry in ledger.weights(live.weights_digest or "")}

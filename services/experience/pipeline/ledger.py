"""Where live versions are issued and their weights found: the :class:`VersionLedger` the weight-sync stage asks.

A version is issued once, by the ledger: an update *claims* what it updates (the deployment's ``policy`` or
``critic``, or one LoRA run's adapter), is told the version live then, and *commits* the version it made live
together with its weights, or releases the claim when it failed. Two updates of one thing never run at once, on any
replica (the second is refused, RESOURCE_EXHAUSTED). A base ``policy`` update is refused while LoRA runs exist
(their adapters sit on the base), whichever replica holds them.

Two implementations: :class:`LocalLedger` for one process (an in-process maker: versions in memory, weights are
the models' own), and the state store's (:class:`services.experience.state.ledger.StoredLedger`), shared by every
experience replica and kept across restarts, with each version's weights written by reference
(:mod:`services.common.weights.blobs`) so any replica loads the live version from there.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Protocol

from services.common.errors import FailedPrecondition, InvalidRequest, Overloaded
from services.common.versions import Claim, Live, Snapshot
from services.common.weights import TensorEntry


class VersionLedger(Protocol):
    """Issues versions and finds their weights (module docs)."""

    #: Whether committed versions' weights can be loaded back (:meth:`weights`): then a replica lagging behind, or a
    #: generator replica, is brought up to date from them, never from a process's memory.
    by_reference: bool

    async def claim(self, *, target: str | None = None, run_id: str | None = None) -> Claim:
        """Claim an update of ``target`` (``policy``, ``critic``) or of LoRA run ``run_id``'s adapter.

        Raises:
            Overloaded: another update of it is in progress. FailedPrecondition: a ``policy`` update while LoRA
            runs exist. NotFound: no run ``run_id``. NotReady: the ledger's store is unavailable.
        """
        ...

    async def put(self, entries: Sequence[TensorEntry], digest: str | None = None) -> str | None:
        """Store ``entries`` by reference (before the update they belong to is committed); returns their digest
        for :meth:`commit` (None: not by reference). ``digest``: theirs from :meth:`digest`, not computed again.

        Raises:
            NotReady: the weights' folder cannot be written.
        """
        ...

    async def digest(self, entries: Sequence[TensorEntry], data_sha256: str | None = None) -> str | None:
        """The digest :meth:`put` would return for ``entries``, computed without storing them (None: not by
        reference): an update names its weights on the replicas with it while they are stored. ``data_sha256``:
        the hex SHA-256 of their bytes in order where known (hashed as they arrived): not computed again."""
        ...

    async def commit(self, claim: Claim, version: int | None, entries: Sequence[TensorEntry] | None = None, *,
                     digest: str | None = None) -> str | None:
        """End ``claim``: ``version`` is live with the weights ``entries`` (stored by reference first) or those
        :meth:`put` stored as ``digest``, or (``version`` None) the update failed and the version live before stays.
        Returns the weights' digest (None: not by reference, or no version).

        Raises:
            NotReady: the store is unavailable, or the claim had expired and another update took it over (the
                version is not live: the caller's update must be repeated).
        """
        ...

    async def snapshot(self) -> Snapshot:
        """Every live version now (:class:`Snapshot`).

        Raises:
            NotReady: the store is unavailable.
        """
        ...

    def weights(self, digest: str) -> list[TensorEntry]:
        """The tensors of a committed version's weights, verified (blocking: call it off the event loop).

        Raises:
            NotReady: missing or corrupt.
        """
        ...


async def claim_update(ledger: VersionLedger, *, target: str | None = None, run_id: str | None = None) -> Claim:
    """``ledger``'s claim of an update (:meth:`VersionLedger.claim`); an update cancelled while it is being claimed
    releases it once the claim is made (else it would hold the model or run until the claim expires)."""
    claiming = asyncio.ensure_future(ledger.claim(target=target, run_id=run_id))
    try:
        return await asyncio.shield(claiming)
    except asyncio.CancelledError:
        claiming.add_done_callback(lambda done: None if done.cancelled() or done.exception() else
                                   asyncio.ensure_future(ledger.commit(done.result(), None)))
        raise


def next_version(requested: int | None, current: int) -> int:
    """The version an update makes live: the sender's ``requested``, else the live one (``current``) + 1.

    Raises:
        InvalidRequest: ``header.policy_version`` is not after the live one.
    """
    version = current + 1 if requested is None else requested
    if version <= current:
        raise InvalidRequest("header.policy_version", f"{version} is not after the live version {current}")
    return version


class LocalLedger:
    """:class:`VersionLedger` of one process: versions in memory, weights not kept (the models hold the live
    ones: ``by_reference`` False). ``lora_runs()`` names the LoRA runs that exist (a base update refuses)."""

    by_reference = False

    def __init__(self, lora_runs: Callable[[], Iterable[str]] = tuple) -> None:
        self._live: dict[tuple[str, str], Live] = {}
        self._claims: dict[tuple[str, str], str] = {}
        self._lora_runs = lora_runs

    @staticmethod
    def _key(target: str | None, run_id: str | None) -> tuple[str, str]:
        return ("run", run_id) if run_id is not None else ("model", target or "policy")

    async def claim(self, *, target: str | None = None, run_id: str | None = None) -> Claim:
        key = self._key(target, run_id)
        if key in self._claims:
            raise Overloaded(f"run_id: another update of run {run_id!r}'s adapter is in progress" if run_id
                             else f"another {target} weight update is in progress")
        if key == ("model", "policy") and (runs := sorted(self._lora_runs())):
            raise FailedPrecondition(
                f"header.target: LoRA runs {', '.join(runs)} sample adapters over the base model; updating it "
                "would change their policies under them (delete them first)")
        claim = Claim(uuid.uuid4().hex, self._live.get(key, Live()), target, run_id)
        self._claims[key] = claim.claim_id
        return claim

    async def put(self, entries: Sequence[TensorEntry], digest: str | None = None) -> str | None:
        return None

    async def digest(self, entries: Sequence[TensorEntry], data_sha256: str | None = None) -> str | None:
        return None

    async def commit(self, claim: Claim, version: int | None, entries: Sequence[TensorEntry] | None = None, *,
                     digest: str | None = None) -> str | None:
        key = self._key(claim.target, claim.run_id)
        if self._claims.get(key) == claim.claim_id:
            del self._claims[key]
            if version is not None:
                self._live[key] = replace(claim.live, version=version)
        return None

    async def snapshot(self) -> Snapshot:
        models = {name: live for (kind, name), live in self._live.items() if kind == "model"}
        adapters = {name: live for (kind, name), live in self._live.items() if kind == "run"}
        return Snapshot(models.get("policy", Live()), models.get("critic", Live()), adapters)

    def forget(self, run_id: str) -> None:
        """A LoRA run was deleted: its adapter's version goes (a run of that id later starts again at 0)."""
        self._live.pop(("run", run_id), None)

    def weights(self, digest: str) -> list[TensorEntry]:
        raise NotImplementedError("a local ledger keeps no weights (by_reference is False)")

"""The weight-sync stage: policy and critic updates from trainers, and the live policy version.

Versions are issued by the :class:`~services.experience.pipeline.ledger.VersionLedger` (the state store's, shared
by every experience replica): an update claims what it updates (one update of a thing at a time, on any replica),
and its version is the sender's ``policy_version``, else the live one + 1. A policy update is checked against the
actor replica, forwarded to the generator fleet with that version (live there once every replica that stays has
it), copied into the actor replica between forward passes, then committed to the ledger with its weights (stored
by reference). While it runs, aborting partial rollouts stop (:meth:`VersionClock.update_begun`). A critic update
is checked and copied into the critic. Nothing is applied anywhere unless the whole update checks out.

Another experience replica's update reaches this one through the ledger: :meth:`WeightSync.catch_up` loads the live
versions' weights this replica lacks (actor, critic, LoRA runs' adapters) from their blobs, and moves the local
clocks, so streams here sample and forward the live version. A generator replica that restarted or joined late is
sent the live version's weights from the ledger's blobs (:meth:`WeightSync.sync_replica`), never another
process's memory (adapters named by their digest); with a local ledger, from the actor replica. One lock serializes
updates, catch-ups, such syncs and the removal of a deleted LoRA run's adapter, so a replica is never sent
half-updated weights under either version's number, nor an adapter being removed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from services.common import metrics
from services.common.deadlines import Deadline
from services.common.errors import FailedPrecondition, InvalidRequest, UpstreamTimeout
from services.common.lora import AdapterConfig, check_adapter, expected_tensors
from services.common.tasks import run_to_end
from services.common.versions import Claim, Live, Snapshot
from services.common.weights import ReceivedUpdate, TensorEntry, TensorSpec, check_update
from services.common.weights.staging import module_spec, tensor_entries, update_tensors
from services.experience.pipeline.adapter_blobs import stored_or_put_back
from services.experience.pipeline.events import Generator
from services.experience.pipeline.forwarder import Forwarder
from services.experience.pipeline.ledger import LocalLedger, VersionLedger, claim_update, next_version
from services.experience.pipeline.versions import PolicyClocks

if TYPE_CHECKING:  # annotations only: the pipeline takes any replica client
    import torch

    from services.experience.fleet.replicas import ReplicaClient

logger = logging.getLogger(__name__)

#: Deadline (s) of the ``ModelInfo`` call a replica's sync starts with: a hung one must not hold every update.
INFO_TIMEOUT_S = 30.0


class WeightSync:
    """Applies updates to the generator and the forwarder's models, in step (module docs)."""

    def __init__(self, generator: Generator, forwarder: Forwarder, clocks: PolicyClocks, sync_timeout_s: float = 600.0,
                 ledger: VersionLedger | None = None) -> None:
        self._generator = generator
        self._forwarder = forwarder
        self.clocks = clocks
        self.policy = clocks.base
        self.critic_version = 0
        self.ledger = ledger if ledger is not None else LocalLedger(forwarder.adapter_versions)
        #: Told each new live policy version the ledger shows (not while an update of it is applied): the generator
        #: fleet follows it (``ReplicaSet.follow``), so it routes to replicas at the version live everywhere
        self.on_policy_live: Callable[[int], None] = lambda version: None
        self._followed: int | None = None
        self._held: dict[str, str] = {}  # the blob this replica's copy of each model/adapter is (by reference)
        self._sync_timeout_s = sync_timeout_s
        self._applying = asyncio.Lock()  # a policy update or a replica sync; the actor replica is stable outside it

    def spec(self, target: str) -> dict[str, TensorSpec]:
        """The tensors an update of ``target`` is checked against as it arrives (the actor replica's or the critic's).

        Raises:
            InvalidRequest: ``header.target`` is the critic and this service runs none.
        """
        tensors = self._forwarder.critic_tensors() if target == "critic" else self._forwarder.actor_tensors()
        if tensors is None:
            raise InvalidRequest("header.target", "this experience service runs no critic (set critic_model)")
        return module_spec(tensors)

    async def update(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        """Apply a received update to its target (``policy``: generator, then actor replica; ``critic``).

        Raises:
            InvalidRequest: a tensor the model does not have (named), a wrong shape, no critic, a
                ``policy_version`` not after the live one; the generator's rejection. Nothing was applied anywhere.
            NotReady, UpstreamTimeout, Overloaded: the generator did not apply it; nothing changed here.
        """
        if update.target == "critic":
            await self._update_critic(update)
        else:
            await self._update_policy(update, deadline)

    async def _update_critic(self, update: ReceivedUpdate) -> None:
        tensors = self._forwarder.critic_tensors()
        if tensors is None:
            raise InvalidRequest("header.target", "this experience service runs no critic (set critic_model)")
        check_update(update.entries, module_spec(tensors))
        async with self._applying:
            claim = await claim_update(self.ledger, target="critic")
            version = None
            try:
                await self._catch_up_critic(claim.live)  # the update applies to the live critic (as the policy's)
                await self._forwarder.load_critic(update.entries, tensors)
                version = max(claim.live.version, self.critic_version) + 1
            finally:
                await run_to_end(self._commit(claim, version, tensor_entries(tensors), "critic"), "the critic's commit")
            self.critic_version = version

    def adapter_spec(self, config: AdapterConfig) -> dict[str, TensorSpec]:
        """The tensors a LoRA run's adapter update with ``config`` is checked against as it arrives (peft names,
        any floating dtype up to float32).

        Raises:
            FailedPrecondition: this service serves no LoRA runs.
        """
        expected = expected_tensors(config, self._forwarder.adapter_modules())
        return {name: TensorSpec(shape, "float32") for name, shape in expected.items()}

    async def update_adapter(self, name: str, config: AdapterConfig, update: ReceivedUpdate, deadline: Deadline) -> int:
        """Apply a LoRA run's adapter update: checked whole, loaded on every generator replica, then into the
        forwarder's adapters; live as ``update.policy_version`` (else the run's version + 1). Returns that version.
        Only the run's own clock moves: another run's groups neither abort nor wait. By reference, the replicas
        are told the adapter's digest first and its blob is written while they load it. Once claimed, the update
        runs to its end even if its caller is cancelled.

        Raises:
            InvalidRequest: a missing, unknown, misshapen or non-finite tensor (named), a ``policy_version`` not
                after the run's live one, or the generator's refusal; nothing was applied anywhere.
            FailedPrecondition: no LoRA runs here, or the generator takes no adapters.
            NotReady, UpstreamTimeout, Overloaded: no generator replica loaded it; nothing changed here.
            NotReady: its blob could not be written; the generator replicas were put back on the live version.
        """
        modules = self._forwarder.adapter_modules()
        check_update(update.entries, self.adapter_spec(config))
        tensors = await asyncio.to_thread(update_tensors, update)
        check_adapter(name, config, tensors, modules, config.rank, values=not update.values_checked)  # all there
        entries = tensor_entries(tensors)  # stored from memory, not read back from the staging folder
        # generator replicas hold it under its blob's digest (its data hashed as it arrived)
        digest = await self.ledger.digest(entries, update.data_sha256)
        async with self._applying:
            claim = await claim_update(self.ledger, run_id=name)
            live = await run_to_end(self._apply_adapter(name, config, tensors, entries, digest, update, claim, deadline),
                                    f"run {name}'s adapter update")
        logger.info("run %s: adapter version %d live (%d tensors, %d bytes)", name, live, len(tensors), update.num_bytes)
        return live

    async def _apply_adapter(self, name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor],
                             entries: list[TensorEntry], digest: str | None, update: ReceivedUpdate, claim: Claim,
                             deadline: Deadline) -> int:
        """:meth:`update_adapter` once claimed: the generator replicas' load and the blob's write at once, then the
        forwarder's copy, the run's clock and the ledger's commit (or release, when it failed)."""
        clock = self.clocks.of(name)
        live = stored = None
        try:
            # the ledger's version when it has one: a run of this name deleted and made again through another
            # replica starts again at 0, whatever this replica's clock of the old run says
            version = next_version(update.policy_version, claim.live.version if self.ledger.by_reference else clock.version)
            stored = None if digest is None else asyncio.ensure_future(self.ledger.put(entries, digest))
            await clock.begin_update()
            try:
                loaded = await self._generator.load_adapter(name, config, tensors, version, deadline,
                                                            weights_digest=digest or "")
                if stored is not None:  # NotReady: not stored, the replicas put back on the ledger's version
                    mine = self._held.get(f"adapter/{name}") == claim.live.weights_digest  # this copy is the live one
                    await stored_or_put_back(stored, digest, self.ledger, self._generator, name, config, loaded,
                                             claim.live, Deadline.from_remaining(self._sync_timeout_s),
                                             functools.partial(self._forwarder.adapter_tensors, name) if mine else None)
                live = loaded
                await self._forwarder.load_adapter(name, config, tensors, live, values_checked=True)
            finally:
                await clock.end_update(live)
        finally:
            if stored is not None:  # ended before the claim is (a failed update's blob is collected unused)
                await asyncio.gather(stored, return_exceptions=True)
            await self._commit(claim, live, entries, f"adapter/{name}", digest)
        return live

    def settled_adapters(self) -> dict[str, tuple[int, str | None]]:
        """What a generator replica must hold to serve: each live adapter no update is being applied to, name →
        (version, the digest of this replica's copy; None: not by reference)."""
        return {name: (version, self._held.get(f"adapter/{name}"))
                for name, version in self.clocks.settled_adapters().items()}

    async def remove_adapter(self, name: str) -> None:
        """Stop using a deleted LoRA run's adapter here: the forwarder's copy goes, then its clock (no longer live:
        no stream may name it and no replica sync sends it). Serialized with updates and syncs, so neither sees it
        half removed; the generator replicas' copies are the caller's to free."""
        async with self._applying:
            await self._forwarder.remove_adapter(name)
            self.clocks.forget(name)

    async def _commit(self, claim: Claim, version: int | None, entries: Sequence[TensorEntry], key: str,
                      digest: str | None = None) -> None:
        """End ``claim`` in the ledger: ``version`` live with ``entries`` (the whole model's or adapter's tensors:
        what a replica starting from nothing loads; stored already as ``digest`` if given) as its weights, or
        released (None); this replica holds it."""
        digest = await self.ledger.commit(claim, version, entries if version is not None else None, digest=digest)
        if version is not None and digest is not None:
            self._held[key] = digest

    async def _update_policy(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        tensors = self._forwarder.actor_tensors()
        check_update(update.entries, module_spec(tensors))
        async with self._applying:  # checked under the lock: no run's first adapter lands between check and update
            if runs := sorted(self._forwarder.adapter_versions()):
                raise FailedPrecondition(
                    f"header.target: LoRA runs {', '.join(runs)} sample adapters over the base model; updating it "
                    "would change their policies under them (delete them first)")
            claim = await claim_update(self.ledger, target="policy")  # FailedPrecondition: LoRA runs on any replica
            version = None
            try:
                # an update may carry only the tensors a step changed: it applies to the live version, which this
                # replica loads first when another replica made it
                await self._catch_up_policy(claim.live)
                # the generator's version adopted at start may be ahead of a store that never saw an update
                requested = next_version(update.policy_version, max(self.policy.version, claim.live.version))
                await self.policy.begin_update()
                try:
                    version = await self._generator.update_weights(update, deadline, requested)
                    # the generator serves it now: the replica must follow even if the caller goes away
                    await run_to_end(self._forwarder.load_actor(update.entries, version, tensors), "the actor's update")
                finally:
                    await self.policy.end_update(version)
            finally:
                # by reference: the actor's every tensor (an update may carry only the tensors a step changed)
                await run_to_end(self._commit(claim, version, tensor_entries(tensors), "policy"), "the policy's commit")
        logger.info("policy version %d live (%d tensors, %d bytes)", version, len(update.entries), update.num_bytes)

    async def sync_replica(self, replica: ReplicaClient, version: Callable[[], int]) -> int:
        """Bring a generator replica to the live policy, unless it serves that version already: by reference, the
        ledger's live version from its blob; else (a local ledger, or version 0: the model folder the actor loaded)
        the actor replica's weights, live as ``version()`` (read once no update is being applied). Then every LoRA
        run's live adapter it lacks, at its version. Returns the policy version the replica then serves.

        Raises:
            NotReady: an update is being applied (on any replica: synced after it), or the ledger is unavailable.
            NotReady, UpstreamTimeout, Overloaded, InvalidRequest: from the replica; it keeps what it had.
        """
        async with self._applying:
            deadline = Deadline.from_remaining(self._sync_timeout_s)
            info = await replica.model_info(min(INFO_TIMEOUT_S, self._sync_timeout_s))
            snapshot = await self._settled_snapshot(deadline) if self.ledger.by_reference else None
            applied = await self._sync_policy(replica, info.policy_version, version, snapshot, deadline)
            if snapshot is None:
                adapters = self.clocks.live_adapters()
                for name, adapter_version in adapters.items():
                    if info.adapters.get(name) != adapter_version:
                        tensors = await self._forwarder.adapter_tensors(name)
                        await replica.load_adapter(name, self._forwarder.adapter_config(name), tensors,
                                                   adapter_version, deadline)
                        logger.info("generator replica given run %s's adapter, version %d", name, adapter_version)
                return applied
            for name, live in snapshot.adapters.items():
                held = (info.adapters.get(name), info.adapter_digests.get(name))  # by digest: not a deleted run's
                if live.version > 0 and live.weights_digest and held != (live.version, live.weights_digest):
                    entries = await asyncio.to_thread(self.ledger.weights, live.weights_digest)
                    tensors = await asyncio.to_thread(lambda entries=entries: {e.name: e.load() for e in entries})
                    await replica.load_adapter(name, snapshot.configs[name], tensors, live.version, deadline,
                                               weights_digest=live.weights_digest)
                    logger.info("generator replica given run %s's adapter, version %d (blob %s)", name,
                                live.version, live.weights_digest)
        return applied

    async def _settled_snapshot(self, deadline: Deadline, poll_s: float = 0.25) -> Snapshot:
        """The ledger's live versions once no update is being applied on any replica (an update through another
        experience replica is moving the generators: a sync waits for it, then follows it).

        Raises:
            UpstreamTimeout: the update did not end before ``deadline``. NotReady: the ledger is unavailable.
        """
        while True:
            snapshot = await self.ledger.snapshot()
            if not snapshot.policy.updating and not any(a.updating for a in snapshot.adapters.values()):
                self._follow(snapshot)
                return snapshot
            if deadline.remaining() <= poll_s:
                raise UpstreamTimeout("a weight update through another experience replica did not end in time")
            await asyncio.sleep(poll_s)  # polling the store: it has no notifications common to both backends

    def _follow(self, snapshot: Snapshot) -> None:
        """Tell :attr:`on_policy_live` a settled live policy version not told yet (0: the generator's own)."""
        live = snapshot.policy
        if live.version and live.weights_digest and not live.updating and live.version != self._followed:
            self._followed = live.version
            self.on_policy_live(live.version)

    async def _sync_policy(self, replica: ReplicaClient, serving: int, version: Callable[[], int],
                           snapshot: Snapshot | None, deadline: Deadline) -> int:
        """The policy part of :meth:`sync_replica`; returns the version the replica serves."""
        if snapshot is not None and snapshot.policy.weights_digest is not None:
            live = snapshot.policy
            if serving == live.version:
                return serving
            entries = await asyncio.to_thread(self.ledger.weights, live.weights_digest)
            pairs = ((entry.name, entry.load()) for entry in entries)  # one tensor in memory at a time
            applied = await replica.load_tensors(pairs, len(entries), live.version, deadline)
            logger.info("generator replica brought to policy version %d from blob %s", applied, live.weights_digest)
            return applied
        live_version = version()
        if serving == live_version:
            return serving
        tensors = list(self._forwarder.actor_tensors().items())
        applied = await replica.load_tensors(iter(tensors), len(tensors), live_version, deadline)
        logger.info("generator replica brought to policy version %d (%d tensors)", applied, len(tensors))
        return applied

    async def catch_up(self) -> Snapshot | None:
        """Bring this replica's models to the ledger's live versions (updates made through other replicas): the
        actor, the critic and each LoRA run's adapter from their blobs, and forget the adapters of runs deleted
        elsewhere; the local clocks move with them (waiters wake, aborting partial rollouts stop). Cheap when nothing
        changed (one read of the ledger). Returns the snapshot it followed (None: a local ledger).

        Raises:
            NotReady: the ledger or a blob is unavailable (this replica keeps what it had).
        """
        if not self.ledger.by_reference:
            return None
        snapshot = await self.ledger.snapshot()
        if self._behind(snapshot):
            async with self._applying:  # read again under the lock: no update of this replica's lands in between
                snapshot = await self.ledger.snapshot()
                await self._catch_up_policy(snapshot.policy)
                await self._catch_up_critic(snapshot.critic)
                await self._catch_up_adapters(snapshot)
        self._follow(snapshot)
        return snapshot

    def _stale(self, key: str, live: Live) -> bool:
        """Whether this replica's copy of ``key`` (``policy``, ``critic``, ``adapter/<run id>``) is not the ledger's
        settled live blob: by digest, so a run deleted and made again at the same version number is loaded anew."""
        return bool(live.weights_digest) and not live.updating and self._held.get(key) != live.weights_digest

    def _behind(self, snapshot: Snapshot) -> bool:
        """Whether this replica's models differ from ``snapshot``'s settled live versions."""
        if self._stale("policy", snapshot.policy):
            return True
        if self._forwarder.critic_tensors() is not None and self._stale("critic", snapshot.critic):
            return True
        if set(self._forwarder.adapter_versions()) - set(snapshot.adapters):
            return True
        return any(self._stale(f"adapter/{name}", live) for name, live in snapshot.adapters.items())

    async def _catch_up_policy(self, live: Live) -> None:
        if not self._stale("policy", live):
            return
        entries = await asyncio.to_thread(self.ledger.weights, live.weights_digest)
        tensors = self._forwarder.actor_tensors()
        check_update(entries, module_spec(tensors))
        await self.policy.begin_update()
        loaded = None
        try:
            await run_to_end(self._forwarder.load_actor(entries, live.version, tensors), "the actor's catch-up")
            loaded = live.version
        finally:
            await self.policy.end_update(loaded)
        self._held["policy"] = live.weights_digest
        metrics.CATCH_UPS.labels("policy").inc()
        logger.info("caught up with policy version %d from blob %s (updated through another replica)",
                    live.version, live.weights_digest)

    async def _catch_up_critic(self, live: Live) -> None:
        tensors = self._forwarder.critic_tensors()
        if tensors is None or not self._stale("critic", live):
            return
        entries = await asyncio.to_thread(self.ledger.weights, live.weights_digest)
        check_update(entries, module_spec(tensors))
        await self._forwarder.load_critic(entries, tensors)
        self.critic_version = live.version
        self._held["critic"] = live.weights_digest
        metrics.CATCH_UPS.labels("critic").inc()
        logger.info("caught up with critic version %d from blob %s", live.version, live.weights_digest)

    async def _catch_up_adapters(self, snapshot: Snapshot) -> None:
        for name in sorted(set(self._forwarder.adapter_versions()) - set(snapshot.adapters)):  # deleted elsewhere
            await self._forwarder.remove_adapter(name)
            self.clocks.forget(name)
            self._held.pop(f"adapter/{name}", None)
            logger.info("run %s was deleted: its adapter is no longer used here", name)
        for name, live in snapshot.adapters.items():
            if not self._stale(f"adapter/{name}", live):
                continue
            entries = await asyncio.to_thread(self.ledger.weights, live.weights_digest)
            tensors = await asyncio.to_thread(lambda entries=entries: {e.name: e.load() for e in entries})
            clock = self.clocks.of(name)
            await clock.begin_update()
            loaded = None
            try:
                await run_to_end(self._forwarder.load_adapter(name, snapshot.configs[name], tensors, live.version),
                                 f"run {name}'s adapter catch-up")
                loaded = live.version
            finally:
                await clock.end_update(loaded)
            self._held[f"adapter/{name}"] = live.weights_digest
            metrics.CATCH_UPS.labels("adapter").inc()
            logger.info("caught up with run %s's adapter version %d from blob %s", name, live.version,
                        live.weights_digest)

"""The weight-sync stage: policy and critic updates from trainers, and the live policy version.

A policy update is checked against the actor replica, forwarded to the generator fleet with the version it makes
live (the sender's ``policy_version``, else the live one + 1; live there once every replica that stays has it),
then copied into the actor replica between forward passes. While it runs, aborting partial rollouts stop
(:meth:`VersionClock.update_begun`). A critic update is checked and copied into the critic. Nothing is applied
anywhere unless the whole update checks out.

The actor replica holds exactly the live version's weights whenever no update is being applied, so it is what a
generator replica that restarted or joined late is sent (:meth:`WeightSync.sync_replica`); one lock serializes
updates, such syncs and the removal of a deleted LoRA run's adapter, so a replica is never sent half-updated
weights under either version's number, nor an adapter being removed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.deadlines import Deadline
from services.common.errors import FailedPrecondition, InvalidRequest
from services.common.lora import AdapterConfig, check_adapter, expected_tensors
from services.common.weight_checks import TensorSpec, check_update
from services.common.weights import ReceivedUpdate, module_spec
from services.experience.pipeline.events import Generator
from services.experience.pipeline.forwarder import Forwarder
from services.experience.pipeline.versions import PolicyClocks, VersionClock

if TYPE_CHECKING:  # annotations only: the pipeline takes any replica client
    from services.experience.fleet.replicas import ReplicaClient

logger = logging.getLogger(__name__)

#: Deadline of the ``ModelInfo`` call that starts a replica's sync (seconds): a serving generator answers it at
#: once, and a hung one must not hold every tenant's updates for the whole sync deadline.
INFO_TIMEOUT_S = 30.0


class WeightSync:
    """Applies updates to the generator and the forwarder's models, in step (module docs)."""

    def __init__(
        self, generator: Generator, forwarder: Forwarder, clocks: PolicyClocks, sync_timeout_s: float = 600.0
    ) -> None:
        self._generator = generator
        self._forwarder = forwarder
        self.clocks = clocks
        self.policy = clocks.base
        self.critic_version = 0
        self._sync_timeout_s = sync_timeout_s
        self._applying = asyncio.Lock()  # a policy update or a replica sync; the actor replica is stable outside it

    def spec(self, target: str) -> dict[str, TensorSpec]:
        """The tensors an update of ``target`` is checked against as it arrives (the actor replica's, or the
        critic's).

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
        await self._forwarder.load_critic(update.entries, tensors)
        self.critic_version += 1

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
        Only the run's own clock moves: another run's groups neither abort nor wait.

        Raises:
            InvalidRequest: a missing, unknown, misshapen or non-finite tensor (named), a ``policy_version`` not
                after the run's live one, or the generator's refusal; nothing was applied anywhere.
            FailedPrecondition: no LoRA runs here, or the generator takes no adapters.
            NotReady, UpstreamTimeout, Overloaded: no generator replica loaded it; nothing changed here.
        """
        modules = self._forwarder.adapter_modules()
        check_update(update.entries, self.adapter_spec(config))
        tensors = await asyncio.to_thread(lambda: {entry.name: entry.load() for entry in update.entries})
        check_adapter(name, config, tensors, modules, config.rank)  # every tensor there, finite
        clock = self.clocks.of(name)
        async with self._applying:
            version = self._next_version(update, clock)
            await clock.begin_update()
            live = None
            try:
                live = await self._generator.load_adapter(name, config, tensors, version, deadline)
                await asyncio.shield(self._forwarder.load_adapter(name, config, tensors, live))
            finally:
                await clock.end_update(live)
        logger.info("run %s: adapter version %d live (%d tensors, %d bytes)", name, live, len(tensors), update.num_bytes)
        return live

    async def remove_adapter(self, name: str) -> None:
        """Stop using a deleted LoRA run's adapter here: the forwarder's copy goes, then its clock (no longer live:
        no stream may name it and no replica sync sends it). Serialized with updates and syncs, so neither sees it
        half removed; the generator replicas' copies are the caller's to free."""
        async with self._applying:
            await self._forwarder.remove_adapter(name)
            self.clocks.forget(name)

    @staticmethod
    def _next_version(update: ReceivedUpdate, clock: VersionClock) -> int:
        """The version an update makes live: the sender's, else the live one + 1.

        Raises:
            InvalidRequest: ``header.policy_version`` is not after the live one.
        """
        requested = clock.version + 1 if update.policy_version is None else update.policy_version
        if requested <= clock.version:
            raise InvalidRequest("header.policy_version", f"{requested} is not after the live version {clock.version}")
        return requested

    async def _update_policy(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        tensors = self._forwarder.actor_tensors()
        check_update(update.entries, module_spec(tensors))
        async with self._applying:  # checked under the lock: no run's first adapter lands between check and update
            if runs := sorted(self._forwarder.adapter_versions()):
                raise FailedPrecondition(
                    f"header.target: LoRA runs {', '.join(runs)} sample adapters over the base model; updating it "
                    "would change their policies under them (delete them first)")
            requested = self._next_version(update, self.policy)
            await self.policy.begin_update()
            version = None
            try:
                version = await self._generator.update_weights(update, deadline, requested)
                # the generator serves it now: the replica must follow even if the caller goes away
                await asyncio.shield(self._forwarder.load_actor(update.entries, version, tensors))
            finally:
                await self.policy.end_update(version)
        logger.info("policy version %d live (%d tensors, %d bytes)", version, len(update.entries), update.num_bytes)

    async def sync_replica(self, replica: ReplicaClient, version: Callable[[], int]) -> int:
        """Bring a generator replica to the live policy: the actor replica's weights, live there as ``version()``
        (read once no update is being applied), unless it serves that version already; then every LoRA run's live
        adapter it lacks at its version. Returns the policy version the replica then serves.

        Raises:
            NotReady, UpstreamTimeout, Overloaded, InvalidRequest: from the replica; it keeps what it had.
        """
        async with self._applying:
            deadline = Deadline.from_remaining(self._sync_timeout_s)
            info = await replica.model_info(min(INFO_TIMEOUT_S, self._sync_timeout_s))
            applied = live = version()
            if info.policy_version != live:
                tensors = list(self._forwarder.actor_tensors().items())
                applied = await replica.load_tensors(iter(tensors), len(tensors), live, deadline)
                logger.info("generator replica brought to policy version %d (%d tensors)", applied, len(tensors))
            for name, adapter_version in self.clocks.live_adapters().items():
                if info.adapters.get(name) != adapter_version:
                    config = self._forwarder.adapter_config(name)
                    tensors = await self._forwarder.adapter_tensors(name)
                    await replica.load_adapter(name, config, tensors, adapter_version, deadline)
                    logger.info("generator replica given run %s's adapter, version %d", name, adapter_version)
        return applied

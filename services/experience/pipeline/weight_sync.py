"""The weight-sync stage: policy and critic updates from trainers, and the live policy version.

A policy update is checked against the actor replica, forwarded to the generator fleet with the version it makes
live (the sender's ``policy_version``, else the live one + 1; live there once every replica that stays has it),
then copied into the actor replica between forward passes. While it runs, aborting partial rollouts stop
(:meth:`VersionClock.update_begun`). A critic update is checked and copied into the critic. Nothing is applied
anywhere unless the whole update checks out.

The actor replica holds exactly the live version's weights whenever no update is being applied, so it is what a
generator replica that restarted or joined late is sent (:meth:`WeightSync.sync_replica`); one lock serializes
updates and such syncs, so a replica is never sent half-updated weights under either version's number.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.weight_checks import TensorSpec, check_update
from services.common.weights import ReceivedUpdate, module_spec
from services.experience.pipeline.events import Generator
from services.experience.pipeline.forwarder import Forwarder
from services.experience.pipeline.versions import VersionClock

if TYPE_CHECKING:  # annotations only: the pipeline takes any replica client
    from services.experience.fleet.replicas import ReplicaClient

logger = logging.getLogger(__name__)


class WeightSync:
    """Applies updates to the generator and the forwarder's models, in step (module docs)."""

    def __init__(
        self, generator: Generator, forwarder: Forwarder, policy: VersionClock, sync_timeout_s: float = 600.0
    ) -> None:
        self._generator = generator
        self._forwarder = forwarder
        self.policy = policy
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

    async def _update_policy(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        tensors = self._forwarder.actor_tensors()
        check_update(update.entries, module_spec(tensors))
        async with self._applying:
            requested = self.policy.version + 1 if update.policy_version is None else update.policy_version
            if requested <= self.policy.version:
                raise InvalidRequest(
                    "header.policy_version", f"{requested} is not after the live version {self.policy.version}"
                )
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
        """Send a generator replica the actor replica's weights (the live policy's), live there as ``version()``
        (read once no update is being applied); returns the version the replica then serves.

        Raises:
            NotReady, UpstreamTimeout, Overloaded, InvalidRequest: from the replica; it keeps what it had.
        """
        async with self._applying:
            tensors = list(self._forwarder.actor_tensors().items())
            live = version()
            deadline = Deadline.from_remaining(self._sync_timeout_s)
            applied = await replica.load_tensors(iter(tensors), len(tensors), live, deadline)
        logger.info("generator replica brought to policy version %d (%d tensors)", applied, len(tensors))
        return applied

"""The weight-sync stage: policy and critic updates from trainers, and the live policy version.

A policy update is checked against the actor replica, forwarded to the generator (live there when it answers),
then copied into the actor replica between forward passes; the live version becomes the generator's new one.
While it runs, aborting partial rollouts stop (:meth:`PolicyState.update_begun`). A critic update is checked and
copied into the critic. Nothing is applied anywhere unless the whole update checks out.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.weights import ReceivedUpdate, check_update, module_spec
from services.experience.events import Generator
from services.experience.forwarder import Forwarder
from services.experience.policy import PolicyState

logger = logging.getLogger(__name__)


class WeightSync:
    """Applies updates to the generator and the forwarder's models, in step (module docs)."""

    def __init__(self, generator: Generator, forwarder: Forwarder, policy: PolicyState) -> None:
        self._generator = generator
        self._forwarder = forwarder
        self.policy = policy
        self.critic_version = 0

    async def update(self, update: ReceivedUpdate, deadline: Deadline) -> None:
        """Apply a received update to its target (``policy``: generator, then actor replica; ``critic``).

        Raises:
            InvalidRequest: a tensor the model does not have (named), a wrong shape, no critic; the generator's
                rejection. Nothing was applied anywhere.
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
        await self.policy.begin_update()
        version = None
        try:
            version = await self._generator.update_weights(update, deadline)
            # the generator serves it now: the replica must follow even if the caller goes away
            await asyncio.shield(self._forwarder.load_actor(update.entries, version, tensors))
        finally:
            await self.policy.end_update(version)
        logger.info("policy version %d live (%d tensors, %d bytes)", version, len(update.entries), update.num_bytes)

"""A LoRA run's adapter on the generator fleet: each update sent to every serving replica at once, and the
adapter freed on every replica when its run is deleted.

A replica that fails the load is taken out (its streams rerouted) and, like a replica that restarts or joins late,
gets every live adapter from the set's weight source before it serves again (``ReplicaSet`` compares its
``ModelInfo.adapters`` with the live versions on each probe). So a sample never reaches a replica without its
run's adapter, and a completion's ``policy_version`` is the adapter version it was sampled with.

A deleted run's adapter is no longer live: no stream names it and no resync sends it. :func:`unload_adapter` frees
it on every replica (``UnloadAdapter``); a replica that cannot be told (down, restarting, too slow) is logged and
marked (``Replica.stale_adapters``): its next successful probe takes it out of routing and unloads the copy before
it serves again (a restarted replica holds none). A later run of the same name, whose versions start again at 1,
never samples that copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from services.common.deadlines import Deadline
from services.common.errors import FailedPrecondition, FastexpError, InvalidRequest, NotReady
from services.common.lora import AdapterConfig
from services.experience.fleet.replicas import ReplicaSet

logger = logging.getLogger(__name__)

#: The default deadline of unloading an adapter on the replicas (seconds). A generator drops the adapter from its
#: table at once; an HF engine then waits for the ``generate`` chunk it is running. Bounds a run's deletion when a
#: replica hangs.
UNLOAD_TIMEOUT_S = 30.0


async def load_adapter(
    members: ReplicaSet, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int,
    deadline: Deadline, *, weights_digest: str = "",
) -> int:
    """Load adapter ``name`` (peft-named tensors) live as ``version``, named ``weights_digest`` (its blob's: each
    replica reports it back, :func:`~services.experience.fleet.replica_state.lacks_adapters`), on every routable
    replica in parallel; returns ``version`` once every replica that stays has it.

    Raises:
        NotReady: no replica serves (nothing loaded).
        InvalidRequest, FailedPrecondition: every replica refused it (the adapter, or a generator that takes none);
            their previous version serves on.
        UpstreamTimeout, Overloaded, NotReady: no replica loaded it; each is probed again and resynced before it
            gets work.
    """
    targets = [r for r in members.replicas if members.routable(r)]
    if not targets:
        raise NotReady(f"no generator replica serves to load adapter {name!r}: {members.describe()}")
    results = await asyncio.gather(
        *(r.client.load_adapter(name, config, tensors, version, deadline, weights_digest=weights_digest)
          for r in targets), return_exceptions=True,
    )
    failed = [(r, result) for r, result in zip(targets, results, strict=True) if isinstance(result, BaseException)]
    for replica, result in zip(targets, results, strict=True):
        if not isinstance(result, BaseException):
            members.adapter_loaded(replica, name)
    errors = [error for _, error in failed]
    if len(failed) == len(targets) and all(isinstance(e, InvalidRequest | FailedPrecondition) for e in errors):
        raise errors[0]  # the adapter's fault (or the deployment's), not the replicas': none changed
    for replica, error in failed:  # it may or may not have loaded it: its next probe tells, and resyncs it
        members.update_failed(replica, f"adapter {name!r} version {version} failed to load: {error}")
    if len(failed) == len(targets):
        raise next((e for e in errors if isinstance(e, FastexpError)), errors[0])
    return version


@dataclass(frozen=True)
class UnloadOutcome:
    """What unloading an adapter did, per replica address: ``unloaded``, those that held it and freed it;
    ``absent``, those that held none of that name; ``failed``, those that could not be told (address → why), which
    may still hold it."""

    unloaded: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)


def unload_outcome(addresses: Sequence[str], results: Sequence[bool | BaseException]) -> UnloadOutcome:
    """Sort each replica's ``UnloadAdapter`` result (``unloaded``, or the error it raised) by address, in order."""
    unloaded, absent, failed = [], [], {}
    for address, result in zip(addresses, results, strict=True):
        if isinstance(result, BaseException):
            failed[address] = str(result) or type(result).__name__
        else:
            (unloaded if result else absent).append(address)
    return UnloadOutcome(tuple(unloaded), tuple(absent), failed)


async def unload_adapter(members: ReplicaSet, name: str, deadline: Deadline) -> UnloadOutcome:
    """Free adapter ``name`` on every known replica in parallel, whatever its state (one syncing, draining or taken
    out may hold it too); requests already sampling with it there finish on it. Never raises for a replica: one
    that fails is logged and marked, and unloads it before it serves again (module docs)."""
    replicas = members.replicas
    results = await asyncio.gather(*(r.client.unload_adapter(name, deadline) for r in replicas),
                                   return_exceptions=True)
    outcome = unload_outcome([r.address for r in replicas], results)
    for replica in replicas:
        if replica.address in outcome.failed:
            members.adapter_unload_failed(replica, name)
            logger.warning("generator replica %s did not unload adapter %r (unloaded before it serves again): %s",
                           replica.address, name, outcome.failed[replica.address])
    logger.info("adapter %r unloaded from %d generator replicas (%d held none, %d not reached)", name,
                len(outcome.unloaded), len(outcome.absent), len(outcome.failed))
    return outcome

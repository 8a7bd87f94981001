"""A LoRA run's adapter on the generator fleet: each update sent to every serving replica at once.

A replica that fails the load is taken out (its streams rerouted) and, like a replica that restarts or joins late,
gets every live adapter from the set's weight source before it serves again (``ReplicaSet`` compares its
``ModelInfo.adapters`` with the live versions on each probe). So a sample never reaches a replica without its
run's adapter, and a completion's ``policy_version`` is the adapter version it was sampled with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from services.common.deadlines import Deadline
from services.common.errors import FailedPrecondition, FastexpError, InvalidRequest, NotReady
from services.common.lora import AdapterConfig
from services.experience.fleet.replicas import ReplicaSet


async def load_adapter(
    members: ReplicaSet, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor], version: int,
    deadline: Deadline,
) -> int:
    """Load adapter ``name`` (peft-named tensors) live as ``version`` on every routable replica in parallel;
    returns ``version`` once every replica that stays has it.

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
        *(r.client.load_adapter(name, config, tensors, version, deadline) for r in targets), return_exceptions=True
    )
    failed = [(r, result) for r, result in zip(targets, results, strict=True) if isinstance(result, BaseException)]
    errors = [error for _, error in failed]
    if len(failed) == len(targets) and all(isinstance(e, InvalidRequest | FailedPrecondition) for e in errors):
        raise errors[0]  # the adapter's fault (or the deployment's), not the replicas': none changed
    for replica, error in failed:  # it may or may not have loaded it: its next probe tells, and resyncs it
        members.update_failed(replica, f"adapter {name!r} version {version} failed to load: {error}")
    if len(failed) == len(targets):
        raise next((e for e in errors if isinstance(e, FastexpError)), errors[0])
    return version

"""The gRPC edge of runs: ``CreateRun``, ``GetRun``, ``ListRuns``, ``DeleteRun`` over a
:class:`~services.experience.runs.registry.RunRegistry`, and the run records to and from the wire.

Each method decodes the request into the registry's plain values, asks the registry as the calling identity
(:func:`services.common.identity.current_caller`, set by the auth interceptor) and encodes the answer; the registry
raises the domain errors the error interceptor maps (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
ALREADY_EXISTS, FAILED_PRECONDITION, RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import grpc

from fastexp.v1 import experience_pb2
from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidRequest, Overloaded
from services.common.identity import current_caller
from services.experience.config import ExperienceConfig
from services.experience.runs.limits import LoraSpec, RunLimits
from services.experience.runs.metrics import RunGauges
from services.experience.runs.registry import Run, RunRegistry, RunStatus

logger = logging.getLogger(__name__)


def check_lora_stream(config: ExperienceConfig, run: Run, adapter_version: int) -> None:
    """Whether a stream of ``run`` (a LoRA run when ``run.lora`` is set) can run as ``config`` asks, its adapter at
    ``adapter_version`` (0: none sent yet).

    Raises:
        FailedPrecondition: naming ``run_id``: the run's adapter was never sent (``update_weights(..., run_id=)``).
        InvalidRequest: naming ``advantage_estimator`` (a critic: the service's value model is no run's own) or
            ``agent`` (agent episodes sample the base model through the gateway).
    """
    if run.lora is None:
        return
    if adapter_version == 0:
        raise FailedPrecondition(f"run_id: LoRA run {run.run_id!r} has no adapter yet; send its weights with "
                                 "update_weights(tensors, run_id=...) before streaming it")
    if config.estimator.needs_critic:
        raise InvalidRequest("advantage_estimator", "a LoRA run has no critic of its own here; use a critic-free "
                                                    "estimator (group_norm, rloo, reinforce_baseline, ...)")
    if config.agent is not None:
        raise InvalidRequest("agent", "agent episodes sample the base model; LoRA runs stream single-turn or "
                                      "environment episodes")


def lora_from_pb(message: experience_pb2.LoraSpec) -> LoraSpec:
    """The adapter a CreateRun asks for, as sent (defaults are the registry's to fill)."""
    return LoraSpec(message.rank, message.alpha, tuple(message.target_modules))


def limits_from_pb(message: experience_pb2.RunLimits) -> RunLimits:
    """The limits a CreateRun asks for (0: the operator's default)."""
    return RunLimits(message.max_streams, message.max_groups_ahead, message.max_tokens_per_request, message.weight)


def run_to_pb(status: RunStatus, policy_version: int, usage: tuple[int, int] | None = None) -> experience_pb2.Run:
    """``status`` on the wire; ``policy_version`` is the live version its streams sample, ``usage`` its groups
    generating and waiting for generator capacity (absent when not given)."""
    run, limits = status.run, status.run.limits
    message = experience_pb2.Run(
        run_id=run.run_id, policy_version=policy_version, streams_open=status.streams_open,
        created_at_unix_s=run.created_at_unix_s, owner=run.owner_display,
        limits=experience_pb2.RunLimits(
            max_streams=limits.max_streams, max_groups_ahead=limits.max_groups_ahead,
            max_tokens_per_request=limits.max_tokens_per_request, weight=limits.weight,
        ),
    )
    if usage is not None:
        message.groups_in_flight, message.groups_queued = usage
    if run.lora is not None:
        message.lora.CopyFrom(experience_pb2.LoraSpec(
            rank=run.lora.rank, alpha=run.lora.alpha, target_modules=list(run.lora.target_modules)))
    return message


class RunMethods:
    """The run RPCs of ``fastexp.v1.ExperienceService`` (module docs), mixed into its servicer, which provides
    ``_runs`` (the registry), ``_updating`` (the LoRA runs whose adapter is being updated or freed, by run id),
    :meth:`_policy_version`, :meth:`_share_usage`, :meth:`_served_lora_rank` and :meth:`_run_deleted`."""

    _runs: RunRegistry
    _updating: set[str]

    def _policy_version(self, run: Run) -> int:
        """The live policy version ``run`` samples: its adapter's, or the deployment's base model's."""
        raise NotImplementedError

    def _served_lora_rank(self) -> int:
        """The highest LoRA rank the deployment serves now (0: none)."""
        raise NotImplementedError

    async def _run_deleted(self, run: Run) -> None:
        """Free what the deleted ``run`` held outside the registry (its adapter)."""
        raise NotImplementedError

    def _share_usage(self, run_id: str) -> tuple[int, int]:
        """The run's prompt groups generating now and waiting for generator capacity."""
        raise NotImplementedError

    def run_gauges(self) -> list[RunGauges]:
        """Every run's live values, for the per-run metrics (:mod:`services.experience.runs.metrics`)."""
        gauges = []
        for status in self._runs.statuses():
            in_flight, queued = self._share_usage(status.run.run_id)
            gauges.append(RunGauges(status.run.run_id, status.streams_open, self._policy_version(status.run),
                                    in_flight, queued))
        return gauges

    def _run_pb(self, status: RunStatus) -> experience_pb2.Run:
        return run_to_pb(status, self._policy_version(status.run), self._share_usage(status.run.run_id))

    async def CreateRun(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.CreateRunRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.Run:
        lora = lora_from_pb(request.lora) if request.HasField("lora") else None
        return self._run_pb(await self._runs.create(request.run_id, current_caller(), lora, limits_from_pb(request.limits),
                                              self._served_lora_rank))

    async def GetRun(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.Run:
        return self._run_pb(await self._runs.get(request.run_id, current_caller()))

    async def ListRuns(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.ListRunsResponse:
        return experience_pb2.ListRunsResponse(runs=[self._run_pb(s) for s in await self._runs.list(current_caller())])

    async def DeleteRun(  # noqa: N802 - gRPC method name
        self, request: experience_pb2.DeleteRunRequest, context: grpc.aio.ServicerContext
    ) -> experience_pb2.Run:
        caller = current_caller()
        run = (await self._runs.get(request.run_id, caller)).run  # NOT_FOUND, PERMISSION_DENIED before anything else
        if run.lora is not None and run.run_id in self._updating:
            raise Overloaded(f"run_id: run {run.run_id!r}'s adapter is being updated; delete the run once that "
                             "update has answered")
        status = await self._runs.delete(run.run_id, caller)
        last = self._run_pb(status)  # as it was: its live version before its adapter goes
        for counter in (metrics.RUN_SAMPLES, metrics.RUN_TOKENS):  # a later run of that name counts from 0
            with contextlib.suppress(KeyError):
                counter.remove(run.run_id)
        if run.lora is not None:
            # Its adapter is freed whole even if this call is cancelled, and no update of a new run of that name
            # starts before it is (that update would be freed with it): the id stays busy until the task ends.
            self._updating.add(run.run_id)
            cleanup = asyncio.ensure_future(self._run_deleted(run))
            cleanup.add_done_callback(functools.partial(_cleanup_done, self._updating, run.run_id))
            await asyncio.shield(cleanup)
        return last


def _cleanup_done(updating: set[str], run_id: str, task: asyncio.Future[None]) -> None:
    """A deleted LoRA run's adapter is freed (or failed to be): its id is free again; a failure is logged (the
    caller that asked may be gone)."""
    updating.discard(run_id)
    if not task.cancelled() and task.exception() is not None:
        logger.error("freeing deleted run %s's adapter failed", run_id, exc_info=task.exception())

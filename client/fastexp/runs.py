"""Runs as the trainer sees them: plain records of ``fastexp.v1.Run`` and the requests that make them.

A run is a named training job on a shared experience service, owned by the bearer token that created it
(:meth:`fastexp.ExperienceClient.create_run`). Stream it with ``make_experiences(..., run_id=...)`` and update it
with ``update_weights(..., run_id=...)``; only its owner, or an admin token, may.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastexp.v1 import experience_pb2


@dataclass(frozen=True)
class RunLimits:
    """A run's limits. Asked for: a field left 0 takes the operator's default. In force (:attr:`Run.limits`):
    every field set. ``max_tokens_per_request`` counts prompts x n_samples_per_prompt x max_new_tokens."""

    max_streams: int = 0  # its MakeExperiences streams open at once
    max_groups_ahead: int = 0  # backpressure of each stream, in prompt groups (kept for the per-run scheduler)
    max_tokens_per_request: int = 0
    weight: int = 0  # share weight of generator capacity (weighted fair share while it is full)


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter over the deployment's base model: ``rank`` r, ``alpha`` (scale alpha / r) and the module
    names it adapts (peft's ``target_modules``)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class Run:
    """A run as the service reports it.

    ``lora``: its adapter (None: the deployment's base model). ``policy_version``: the live version its streams
    sample. ``streams_open``: its MakeExperiences streams now. ``groups_in_flight``/``groups_queued``: its prompt
    groups generating / waiting for capacity (None: not reported by this deployment yet). ``created_at_unix_s``:
    seconds since the Unix epoch. ``owner``: ``"anonymous"`` (tokens off) or ``"sha256:"`` and the first 12 hex
    digits of the SHA-256 of the creating token.
    """

    run_id: str
    lora: LoraSpec | None
    policy_version: int
    streams_open: int
    groups_in_flight: int | None
    groups_queued: int | None
    created_at_unix_s: float
    limits: RunLimits
    owner: str


def create_run_request(
    run_id: str,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    target_modules: Sequence[str] | None = None,
    limits: RunLimits = RunLimits(),
) -> experience_pb2.CreateRunRequest:
    """The CreateRun request: a LoRA run when ``lora_rank`` is given (``lora_alpha`` None: equal to the rank;
    ``target_modules`` None: every module the operator allows), else a run of the base model.

    Raises:
        ValueError: ``lora_alpha`` or ``target_modules`` without ``lora_rank``.
    """
    request = experience_pb2.CreateRunRequest(run_id=run_id, limits=experience_pb2.RunLimits(
        max_streams=limits.max_streams, max_groups_ahead=limits.max_groups_ahead,
        max_tokens_per_request=limits.max_tokens_per_request, weight=limits.weight,
    ))
    if lora_rank is None:
        if lora_alpha is not None or target_modules is not None:
            raise ValueError("lora_alpha and target_modules need lora_rank (a LoRA run)")
        return request
    request.lora.CopyFrom(experience_pb2.LoraSpec(rank=lora_rank, alpha=lora_alpha or 0.0,
                                                  target_modules=list(target_modules or ())))
    return request


def run_from_pb(message: experience_pb2.Run) -> Run:
    """The record of a ``fastexp.v1.Run``."""
    lora = message.lora if message.HasField("lora") else None
    limits = message.limits
    return Run(
        run_id=message.run_id,
        lora=LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules)) if lora is not None else None,
        policy_version=message.policy_version,
        streams_open=message.streams_open,
        groups_in_flight=message.groups_in_flight if message.HasField("groups_in_flight") else None,
        groups_queued=message.groups_queued if message.HasField("groups_queued") else None,
        created_at_unix_s=message.created_at_unix_s,
        limits=RunLimits(limits.max_streams, limits.max_groups_ahead, limits.max_tokens_per_request, limits.weight),
        owner=message.owner,
    )

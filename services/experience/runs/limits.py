"""What a run may ask for: the operator's limits as plain values, and the pure checks of a run's id, LoRA spec and
limits against them (no gRPC, no settings: :mod:`services.experience.server` builds :class:`OperatorLimits` from
the settings once).

Each check raises the domain error a client sees, naming the field: :class:`~fastexp.errors.InvalidRequest`
(INVALID_ARGUMENT: ``run_id``, ``lora.rank``, ``lora.alpha``, ``lora.target_modules``, ``limits.<field>``) or
:class:`~fastexp.errors.FailedPrecondition` (a LoRA run on a deployment that does not serve adapters of its rank).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from fastexp.errors import FailedPrecondition, InvalidRequest
from services.common.lora import AdapterConfig

#: Most characters of a run id (the same as MakeExperiencesRequest.run_id's, services.experience.api.request).
MAX_RUN_ID_CHARS = 256
#: A run id: letters, digits, ``.``, ``_``, ``-``; the first a letter or digit (safe in paths, URLs and labels).
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: The projections of Llama-style attention and MLP blocks: the modules a LoRA run may adapt by default.
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Largest LoRA rank accepted by default (the operator's ``max_lora_rank``).
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class RunLimits:
    """A run's limits. Asked for (CreateRun): a field 0 takes the operator's default. In force: every field set,
    ``max_tokens_per_request`` in tokens (prompts x samples x max_new_tokens)."""

    max_streams: int = 0
    max_groups_ahead: int = 0
    max_tokens_per_request: int = 0
    weight: int = 0


#: The fields of :class:`RunLimits`, in order.
LIMIT_FIELDS = tuple(f.name for f in fields(RunLimits))


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter over the base model: ``rank`` r, ``alpha`` (scale alpha / r; 0 when asked: equal to r) and
    the module names it adapts (empty when asked: every module the operator allows)."""

    rank: int
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class OperatorLimits:
    """The operator's limits on runs: at most ``max_runs`` runs; a run's limits default to ``defaults`` and may
    not exceed ``ceilings`` (field by field); LoRA runs up to ``max_lora_rank`` on ``lora_target_modules``."""

    max_runs: int = 1024
    defaults: RunLimits = RunLimits(max_streams=8, max_groups_ahead=64, max_tokens_per_request=1 << 26, weight=1)
    ceilings: RunLimits = RunLimits(max_streams=64, max_groups_ahead=64, max_tokens_per_request=1 << 26, weight=100)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES

    def __post_init__(self) -> None:
        """Raises ValueError: a default outside 1..its ceiling, or no run, rank or module allowed at all."""
        wrong = [f"{name}: default {getattr(self.defaults, name)} not in 1..{getattr(self.ceilings, name)}"
                 for name in LIMIT_FIELDS
                 if not 1 <= getattr(self.defaults, name) <= getattr(self.ceilings, name)]
        if self.max_runs < 1 or self.max_lora_rank < 1 or not self.lora_target_modules:
            wrong.append("max_runs and max_lora_rank must be >= 1, lora_target_modules non-empty")
        if wrong:
            raise ValueError("; ".join(wrong))


def check_run_id(run_id: str) -> str:
    """``run_id`` when it may name a run: 1..:data:`MAX_RUN_ID_CHARS` characters of :data:`RUN_ID_PATTERN`.

    Raises:
        InvalidRequest: ``run_id``, saying which rule it breaks.
    """
    if not run_id:
        raise InvalidRequest("run_id", "a run needs an id")
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise InvalidRequest("run_id", f"at most {MAX_RUN_ID_CHARS} characters, got {len(run_id)}")
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidRequest("run_id", f"{run_id!r}: only letters, digits, '.', '_' and '-', the first a letter or digit")
    return run_id


def check_lora(spec: LoraSpec, limits: OperatorLimits) -> LoraSpec:
    """The adapter ``spec`` asks for, with its defaults filled in (alpha = rank; every allowed module).

    Raises:
        InvalidRequest: ``lora.rank`` (not 1..max_lora_rank), ``lora.alpha`` (not finite, or negative),
            ``lora.target_modules`` (a module the operator does not allow, or one named twice).
    """
    if not 1 <= spec.rank <= limits.max_lora_rank:
        raise InvalidRequest("lora.rank", f"must be in 1..{limits.max_lora_rank} (the operator's max_lora_rank), "
                                          f"got {spec.rank}")
    if not math.isfinite(spec.alpha) or spec.alpha < 0:
        raise InvalidRequest("lora.alpha", f"must be finite and > 0 (0: equal to rank), got {spec.alpha}")
    unknown = [m for m in spec.target_modules if m not in limits.lora_target_modules]
    if unknown:
        raise InvalidRequest("lora.target_modules", f"{', '.join(map(repr, unknown))} not allowed here; allowed: "
                                                    f"{', '.join(limits.lora_target_modules)}")
    if len(set(spec.target_modules)) != len(spec.target_modules):
        raise InvalidRequest("lora.target_modules", "a module is named twice")
    return LoraSpec(spec.rank, spec.alpha or float(spec.rank), spec.target_modules or limits.lora_target_modules)


def resolve_limits(asked: RunLimits, limits: OperatorLimits) -> RunLimits:
    """The limits a run gets: each field asked for (0: the operator's default), at most the operator's ceiling.

    Raises:
        InvalidRequest: ``limits.<field>`` above its ceiling, naming the ceiling.
    """
    resolved = {}
    for name in LIMIT_FIELDS:
        value, ceiling = getattr(asked, name), getattr(limits.ceilings, name)
        if value > ceiling:
            raise InvalidRequest(f"limits.{name}", f"at most {ceiling} here (the operator's), got {value}")
        resolved[name] = value or getattr(limits.defaults, name)
    return RunLimits(**resolved)


def check_servable(lora: LoraSpec | None, served_rank: int) -> None:
    """Whether the deployment serves ``lora``: ``served_rank`` is the highest rank its generator and forwards take
    (0: no adapters at all).

    Raises:
        FailedPrecondition: ``lora.rank`` above ``served_rank``, or adapters are not served here.
    """
    if lora is None:
        return
    if served_rank == 0:
        raise FailedPrecondition("lora: this deployment serves no LoRA adapters (its generator's max_loras or the "
                                 "experience service's adapters are off); create the run without lora")
    if lora.rank > served_rank:
        raise FailedPrecondition(f"lora.rank: {lora.rank}; this deployment's generator takes adapters up to rank "
                                 f"{served_rank} (its max_lora_rank)")


def adapter_config(lora: LoraSpec) -> AdapterConfig:
    """The adapter config of a LoRA run's (checked, defaults filled) spec: what its updates and engines use."""
    return AdapterConfig(lora.rank, lora.alpha, lora.target_modules)

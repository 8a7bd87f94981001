"""The forwarder stage: the actor, reference (and critic) forward passes over scored groups, and batch assembly.

It owns the models the experience service runs and the lock that serializes their use (forward passes share the
device; weight copies wait for the pass in flight). Forward passes run in a worker thread, on whatever scored
groups are ready, rows sorted by length for padded passes; each group's outputs come back trimmed to its own
response width (:func:`~services.experience.pipeline.assembly.split_forward`) and are re-padded per batch by
:meth:`Forwarder.assemble`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fastexp.types import ForwardOutputs, Rollout
from services.common import metrics
from services.common.errors import FailedPrecondition
from services.common.generation import CompletionRecord
from services.common.lora import AdapterConfig
from services.common.tasks import run_to_end
from services.common.weights import TensorEntry, copy_into
from services.experience.config import ExperienceConfig, ExperienceRequest
from services.experience.pipeline.assembly import concat_forward, split_forward
from services.experience.pipeline.events import ForwardedGroup, ScoredGroup
from services.experience.workers.adapters import AdapterForwards
from services.experience.workers.critic import ValueModel
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.offload import Offloader
from services.experience.workers.sequences import build_rollout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardModels:
    """The models the experience service runs itself; ``critic`` only when configured (``gae`` needs it);
    ``adapters``: the LoRA runs' adapters on the actor's module (None: LoRA runs are not served)."""

    actor: LogProbModel
    reference: LogProbModel
    critic: ValueModel | None = None
    micro_batch_size: int = 8
    share_prompt: bool = True  # packed forwards compute each group's prompt once (forward.shared_prompt_chunks)
    adapters: AdapterForwards | None = None


@dataclass(frozen=True)
class Assembled:
    """A batch's inputs to the estimate, from its forwarded groups in order: the rollout, rewards (B,), reward
    metrics (B,) each (NaN for rows whose scorer lacks one) and the forward outputs (B, A)."""

    rollout: Rollout
    rewards: torch.Tensor
    reward_metrics: dict[str, torch.Tensor]
    forward: ForwardOutputs


class ForwardCores(Protocol):
    """The CPU threads of forward passes on cores shared with an engine
    (:class:`~services.experience.fleet.cores.CoreShare`)."""

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Held from before a pass waits for the models until it ends."""
        ...

    async def threads(self) -> int | None:
        """The threads of the pass about to start (None: leave torch's setting)."""
        ...

    def shared(self) -> bool:
        """Whether the passes share their cores with an engine (it gives up threads for each)."""
        ...


class Forwarder:
    """Runs :class:`ForwardModels` (module docs). ``actor_version``: the policy version of the actor replica's
    weights, changed only together with them, under the lock."""

    def __init__(self, models: ForwardModels, pad_token_id: int, actor_version: int = 0,
                 cores: ForwardCores | None = None) -> None:
        """``cores``: the threads of each forward pass, and the engine's beside them (None: torch's setting)."""
        self._cores = cores
        self._weights_epoch = 0  # +1 per actor or critic update: early rows of older weights are not reused
        self._models = models
        self._pad_token_id = pad_token_id
        self._lock = asyncio.Lock()
        self.actor_version = actor_version
        critic = models.critic.modules if models.critic is not None else {}
        self._offloader = Offloader({"actor": models.actor.module, "reference": models.reference.module, **critic})

    @property
    def has_critic(self) -> bool:
        """Whether a value model runs here."""
        return self._models.critic is not None

    def actor_tensors(self) -> dict[str, torch.Tensor]:
        """The actor replica's parameters by checkpoint name (what a policy update is checked against)."""
        return self._models.actor.tensors()

    def adapter_modules(self) -> dict[str, tuple[int, int]]:
        """The actor's LoRA-able linear layers (name → (out, in)) an adapter update is checked against.

        Raises:
            FailedPrecondition: this service serves no LoRA runs (``max_lora_rank`` 0).
        """
        return self._require_adapters().modules()

    def adapter_versions(self) -> dict[str, int]:
        """The loaded adapters' versions, by name."""
        adapters = self._models.adapters
        return {} if adapters is None else {name: a.version for name, a in adapters.adapters().items()}

    def adapter_config(self, name: str) -> AdapterConfig:
        """The config adapter ``name`` was loaded with (KeyError: not loaded)."""
        return self._require_adapters().adapters()[name].config

    async def load_adapter(self, name: str, config: AdapterConfig, tensors: Mapping[str, torch.Tensor],
                           version: int, values_checked: bool = False) -> None:
        """Load a LoRA run's adapter at ``version`` between forward passes (not cancelled half-way);
        ``values_checked``: the caller ran :func:`~services.common.lora.check_adapter` on these very tensors (their
        values are not scanned again).

        Raises:
            InvalidRequest: :func:`~services.common.lora.check_adapter`'s (the previous version stays).
        """
        adapters = self._require_adapters()
        load = functools.partial(adapters.load, name, config, tensors, version, values_checked=values_checked)
        async with self._lock:
            self._weights_epoch += 1
            await run_to_end(asyncio.to_thread(load), f"run {name}'s adapter load")

    async def remove_adapter(self, name: str) -> bool:
        """Delete a LoRA run's adapter between forward passes; returns whether it was loaded."""
        adapters = self._models.adapters
        if adapters is None:
            return False
        async with self._lock:
            return await asyncio.to_thread(adapters.remove, name)

    async def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """A copy of adapter ``name``'s tensors, peft-named (for a generator replica that lacks it)."""
        adapters = self._require_adapters()
        async with self._lock:
            return await asyncio.to_thread(adapters.tensors, name)

    def _require_adapters(self) -> AdapterForwards:
        if self._models.adapters is None:
            raise FailedPrecondition("lora: this experience service serves no LoRA runs (max_lora_rank 0)")
        return self._models.adapters

    def critic_tensors(self) -> dict[str, torch.Tensor] | None:
        """The critic's parameters by checkpoint name, or ``None`` without a critic."""
        return None if self._models.critic is None else self._models.critic.tensors()

    def early_forwards(self, config: ExperienceConfig) -> bool:
        """Whether :meth:`forward_samples` pays for a request of ``config``: it samples without dynamic sampling
        (which may drop most groups), some model runs for it (the actor unless ``skip_actor_forward``, the reference
        where it needs one, a critic), and the passes do not share their cores with an engine. Where they do (a CPU host), each early pass of a few rows takes the engine's threads for less
        work than it saves: the demo's stream with both forwards ran 3 % faster without them, the reference-only
        stream 9 % (benchmarks/README.md)."""
        runs_a_model = not config.skip_actor_forward or config.needs_reference or config.estimator.needs_critic
        shared = self._cores is not None and self._cores.shared()
        return config.dynamic_sampling is None and runs_a_model and not shared

    def rows_per_pass(self, config: ExperienceConfig) -> int:
        """Rows one :meth:`forward` call takes at most (a batch's micro-rollout, at least the models' micro-batch)."""
        return max(config.micro_rollout_batch_size, self._models.micro_batch_size)

    async def forward(
        self, groups: Sequence[ScoredGroup], request: ExperienceRequest, early: EarlyForwards | None = None
    ) -> tuple[ForwardedGroup, ...]:
        """Each group with its forward outputs (n, a_g), computed in a worker thread under the lock. Rows that
        :meth:`forward_samples` already computed (same prompt and sampled tokens, with the same actor and critic
        weights) are taken from ``early`` instead of being computed again."""
        with self._waiting():
            async with self._lock:
                self._offloader.require_loaded("MakeExperiences")
                threads = await self._cores.threads() if self._cores is not None else None
                adapter = request.adapter
                actor_version = self.actor_version if adapter is None else self.adapter_versions()[adapter]
                done = {} if early is None else early.usable(self._weights_epoch)
                forwards = await asyncio.to_thread(self._forward_groups, groups, request, threads, done)
        if request.config.skip_actor_forward:  # the generator computed them, at each group's sampling version
            return tuple(ForwardedGroup(g, f, g.policy_version) for g, f in zip(groups, forwards, strict=True))
        return tuple(ForwardedGroup(g, f, actor_version) for g, f in zip(groups, forwards, strict=True))

    async def forward_samples(
        self, samples: Sequence[CompletionRecord], request: ExperienceRequest, early: EarlyForwards
    ) -> None:
        """Run the forward passes of finished samples whose groups are still generating, into ``early`` (at the
        current weights), so that their groups need only their remaining rows once complete."""
        with self._waiting():
            async with self._lock:
                self._offloader.require_loaded("MakeExperiences")
                threads = await self._cores.threads() if self._cores is not None else None
                rows = await asyncio.to_thread(self._forward_rows, list(samples), request, threads)
                early.add(samples, rows, self._weights_epoch)

    def _waiting(self) -> contextlib.AbstractContextManager[None]:
        return self._cores.waiting() if self._cores is not None else contextlib.nullcontext()

    async def offload(self) -> tuple[int, tuple[str, ...]]:
        """Move the models to host memory between forward passes (:class:`~services.experience.workers.offload.Offloader`);
        returns (bytes moved, model names)."""
        async with self._lock:
            return await asyncio.to_thread(self._offloader.offload)

    async def reload(self) -> tuple[int, tuple[str, ...]]:
        """Move offloaded models back to their devices; returns (bytes moved, model names)."""
        async with self._lock:
            return await asyncio.to_thread(self._offloader.reload)

    def require_loaded(self, what: str) -> None:
        """Raises FailedPrecondition naming ``what`` while the models are offloaded."""
        self._offloader.require_loaded(what)

    async def load_actor(self, entries: Sequence[TensorEntry], version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a checked policy update into the actor between forward passes; it is then ``version``."""
        async with self._lock:
            self._weights_epoch += 1
            await run_to_end(self._copy_actor(entries, version, tensors), "the actor's copy")

    async def _copy_actor(self, entries: Sequence[TensorEntry], version: int,
                          tensors: Mapping[str, torch.Tensor]) -> None:
        await asyncio.to_thread(copy_into, tensors, entries)
        self.actor_version = version

    async def load_critic(self, entries: Sequence[TensorEntry], tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a checked critic update into the critic between forward passes (not cancelled half-way)."""
        async with self._lock:
            self._weights_epoch += 1
            await run_to_end(asyncio.to_thread(copy_into, tensors, entries), "the critic's copy")

    def assemble(self, groups: Sequence[ForwardedGroup], request: ExperienceRequest) -> Assembled:
        """The batch of ``groups`` (see :class:`Assembled`); counts vision placeholder repairs."""
        rollout = build_rollout(
            [c for g in groups for c in g.scored.completions], request.prompts, self._pad_token_id,
            self._models.actor.vision_tokens,
        )
        if rollout.repaired_vision_tokens:
            metrics.VISION_TOKEN_REPAIRS.labels("response_placeholder").inc(rollout.repaired_vision_tokens)
            logger.debug("%s: %d sampled placeholder tokens replaced by the pad token",
                         request.request_id, rollout.repaired_vision_tokens)
        if rollout.vision_prompt_mismatches:
            metrics.VISION_TOKEN_REPAIRS.labels("prompt_mismatch").inc(rollout.vision_prompt_mismatches)
        forward = concat_forward([g.forward for g in groups], rollout.action_mask.shape[1])
        scores = [g.scored.scores for g in groups]
        names = sorted({name for s in scores for name in s.metrics})
        reward_metrics = {
            name: torch.cat([
                s.metrics[name].float() if name in s.metrics else torch.full((len(s.rewards),), float("nan"))
                for s in scores
            ])
            for name in names
        }
        return Assembled(rollout, torch.cat([s.rewards.float() for s in scores]), reward_metrics, forward)

    def _forward_groups(
        self, groups: Sequence[ScoredGroup], request: ExperienceRequest, threads: int | None = None,
        done: Mapping[RowKey, ForwardOutputs] | None = None,
    ) -> list[ForwardOutputs]:
        """Per-group forward outputs (n, a_g) of ``groups`` (runs in a worker thread, on ``threads`` CPU threads
        when given: torch's thread count is per calling thread, so it is set here). ``done``: rows already
        computed, by :func:`row_key`."""
        done = done or {}
        completions = [c for g in groups for c in g.completions]
        missing = [c for c in completions if row_key(c) not in done]
        computed = dict(zip(map(row_key, missing), self._forward_rows(missing, request, threads), strict=True))
        rows = {**done, **computed}
        return [
            concat_forward([rows[row_key(c)] for c in g.completions],
                           max(1, max(len(c.output_token_ids) for c in g.completions)))
            for g in groups
        ]

    def _forward_rows(
        self, completions: list[CompletionRecord], request: ExperienceRequest, threads: int | None
    ) -> list[ForwardOutputs]:
        """Each completion's forward outputs (1, a_i), in order (runs in a worker thread).

        Padded forwards sort the rows by length first, so each micro-batch pads only to rows of similar length.
        """
        if not completions:
            return []
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        order = list(range(len(completions)))
        if not request.config.packing_samples:
            order.sort(key=lambda i: len(completions[i].prompt_token_ids) + len(completions[i].output_token_ids))
        rollout = build_rollout(
            [completions[i] for i in order], request.prompts, self._pad_token_id, self._models.actor.vision_tokens
        )
        forward = self._run_models(rollout, request.config, request.adapter)
        inverse = torch.empty(len(order), dtype=torch.int64)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        forward = ForwardOutputs(*(None if t is None else t[inverse] for t in forward))
        widths = [max(1, len(c.output_token_ids)) for c in completions]
        return split_forward(forward, [1] * len(completions), widths)

    def _run_models(self, rollout: Rollout, config: ExperienceConfig, adapter: str | None) -> ForwardOutputs:
        """Actor, reference (and critic) passes over the rollout's rows (runs in a worker thread); the actor's
        is skipped with ``skip_actor_forward``, the reference's when the request needs no reference."""
        models = self._models
        # a vision-language model's rows stay padded: its M-RoPE positions are not the packed layouts' 1D ones
        packed = config.packing_samples and models.actor.vision_tokens is None
        parts = chunks(rollout, models.micro_batch_size, packed=packed, share_prompt=models.share_prompt)
        actor, entropy = rollout.rollout_log_probs, None  # skip_actor_forward: the generator's own log-probs
        # a LoRA run's policy is the actor's module with its adapter on, and its reference that module's base
        # (every adapter off: the module's state between passes)
        reference_model = models.reference if adapter is None else models.actor
        reference = None
        if adapter is not None and not config.skip_actor_forward:
            assert models.adapters is not None, "LoRA runs are refused where no adapters are served"
            with metrics.stage_timer("actor"):
                actor, entropy, reference = models.adapters.log_probs(
                    adapter, parts, config.return_action_entropy, with_reference=config.needs_reference)
        elif not config.skip_actor_forward:
            with metrics.stage_timer("actor"):
                actor, entropy = models.actor.action_log_probs(parts, with_entropy=config.return_action_entropy)
        if config.needs_reference and reference is None:
            with metrics.stage_timer("reference"):
                reference, _ = reference_model.action_log_probs(parts)
        values = None
        if config.estimator.needs_critic:
            if models.critic is None:
                raise ValueError("gae needs a critic")  # request validation rejects this first
            with metrics.stage_timer("critic"):
                values = models.critic.values(parts)
        return ForwardOutputs(actor, reference, values, entropy)


class EarlyForwards:
    """One stream's forward outputs of samples computed before their group was whole (:meth:`Forwarder.
    forward_samples`), each (1, a_i) with the forwarder's weights epoch it was computed at. A row is reused for a
    completion with the same prompt and sampled tokens (its outputs depend on nothing else) while no actor or critic
    update came in between. Only the consumer of that stream uses it (one event loop); rows go with their group."""

    def __init__(self) -> None:
        self._rows: dict[RowKey, tuple[ForwardOutputs, int]] = {}

    def add(self, samples: Sequence[CompletionRecord], rows: Sequence[ForwardOutputs], epoch: int) -> None:
        for sample, row in zip(samples, rows, strict=True):
            self._rows[row_key(sample)] = (row, epoch)

    def usable(self, epoch: int) -> dict[RowKey, ForwardOutputs]:
        """Rows computed with the weights of ``epoch``, by :func:`row_key`."""
        return {key: row for key, (row, computed_at) in self._rows.items() if computed_at == epoch}

    def discard(self, prompt_index: int) -> None:
        """Forget ``prompt_index``'s rows (its group was forwarded, dropped, failed or sent back for resampling)."""
        for key in [key for key in self._rows if key[0] == prompt_index]:
            del self._rows[key]

    def __len__(self) -> int:
        return len(self._rows)


#: What a row's forward outputs depend on: (prompt index, sample index, prompt token ids, sampled token ids).
RowKey = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def row_key(completion: CompletionRecord) -> RowKey:
    """The :data:`RowKey` of a completion: two completions with one key have the same forward outputs under the
    same weights."""
    c = completion
    return c.prompt_index, c.sample_index, tuple(c.prompt_token_ids), tuple(c.output_token_ids)

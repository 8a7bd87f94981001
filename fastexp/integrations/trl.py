"""TRL trainers take their rollouts from fastexp: two arguments change, the trainer stays TRL's.

``pip install "fastexp[trl]"`` (TRL 1.16.0). Synchronous GRPO (``trl.GRPOTrainer``)::

    from fastexp.integrations.trl import FastexpRollout, fastexp_reward

    rollout = FastexpRollout("127.0.0.1:50053", dataset=train_dataset, reference_column="answer")
    trainer = GRPOTrainer(model=model, args=GRPOConfig(...), train_dataset=train_dataset,
                          rollout_func=rollout, reward_funcs=[fastexp_reward])
    trainer.train()

The experience service samples (its generator), scores (its scorer: the reward team's sources and recipes) and
returns token ids and the generator's log-probs; TRL computes its own log-probs, advantages and loss. Before each
step's rollouts the trainer's new weights are pushed through ``UpdateWeights`` (``sync_weights``), so the next rows
come from the policy TRL just updated (each row says which: ``policy_version``).

Asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, which needs CUDA kernels)::

    transfer = FastexpWeightTransfer("127.0.0.1:50053")
    worker = FastexpRolloutWorker("127.0.0.1:50053", train_dataset, options, weight_transfer=transfer)
    trainer = AsyncGRPOTrainer(..., rollout_worker=worker, weight_transfer=transfer)

There the rows carry fastexp's advantages (``options.advantage_estimator``), and ``options.max_staleness`` bounds
how many policy versions behind a row may be when it is streamed.

Notation: B rows, P a row's prompt tokens, C its completion tokens (a multi-turn episode's completion holds its
model turns and the environment's observations between them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
import torch

from fastexp.client import ExperienceClient
from fastexp.request import PromptLike, RequestOptions, Sampling
from fastexp.security import ClientTLS
from fastexp.types import Experience

logger = logging.getLogger(__name__)

__all__ = [
    "FastexpRollout", "FastexpRolloutWorker", "FastexpWeightTransfer", "ReferenceTable", "RolloutRow",
    "experience_rows", "fastexp_reward", "policy_weights", "prompt_runs",
]


# --- pure pieces: runs of repeated prompts, rows of an Experience, the policy's weights -------------------------


def prompt_runs(prompts: Sequence[PromptLike]) -> list[tuple[int, int]]:
    """The maximal runs of equal consecutive prompts as ``(start, length)``, in order.

    TRL's ``RepeatSampler`` repeats each prompt ``num_generations`` times in a row, so each run is one GRPO group
    (a process's slice may cut a group at its ends: those runs are shorter). Equal prompts that are not adjacent
    are different groups.

    Example: ``["a", "a", "b", "b", "a"]`` -> ``[(0, 2), (2, 2), (4, 1)]``.
    """
    runs: list[tuple[int, int]] = []
    for index, prompt in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


class RolloutRow(NamedTuple):
    """One row of an Experience, unpadded, in TRL's terms (token ids, not text).

    Shape: ``prompt_ids`` (P,) ints, the prompt as the service rendered it (chat template applied);
    ``completion_ids`` (C,) ints, EOS included when sampled; ``logprobs`` (C,) floats, the generator's log-probs of
    the sampled tokens in nats (0 on observation tokens); ``env_mask`` (C,) ints, 1 on tokens the model sampled,
    0 on the environment's observations (all 1 for single-turn rows).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float  # the scorer's reward, before any shaping
    reward_metrics: dict[str, float]  # the scorer's per-source metrics of this row
    policy_version: int  # version of the weights that sampled it
    advantage: float  # fastexp's advantage at the row's first sampled token (0 when it sampled none)
    response_text: str
    prompt_index: int  # index into the request's prompts
    sample_index: int  # sample within the prompt's group


def experience_rows(experience: Experience) -> list[RolloutRow]:
    """The B rows of a padded Experience (``sequences`` (B, S) with prompts left-padded to ``S - A`` and responses
    right-padded to A, ``action_mask`` (B, A)) as :class:`RolloutRow` s, in row order.

    Raises:
        ValueError: a packed Experience (request ``return_packed=False``).
    """
    if experience.packed_seq_lens is not None:
        raise ValueError("experience_rows needs the padded layout (request return_packed=False)")
    width = experience.sequences.shape[1] - experience.action_mask.shape[1]  # S - A: the padded prompt width
    rows = []
    for r in range(experience.sequences.shape[0]):
        length = int(experience.response_length[r])
        real_prompt = experience.attention_mask[r, :width].bool()
        action = experience.action_mask[r, :length]
        advantages = experience.advantages[r, :length][action]
        rows.append(RolloutRow(
            prompt_ids=experience.sequences[r, :width][real_prompt].tolist(),
            completion_ids=experience.sequences[r, width : width + length].tolist(),
            logprobs=torch.where(action, experience.rollout_log_probs[r, :length], 0.0).tolist(),
            env_mask=action.to(torch.int64).tolist(),
            reward=float(experience.reward[r]),
            reward_metrics={name: float(values[r]) for name, values in experience.reward_metrics.items()},
            policy_version=int(experience.policy_version[r]),
            advantage=float(advantages[0]) if advantages.numel() else 0.0,
            response_text=experience.response_texts[r],
            prompt_index=experience.prompt_index[r],
            sample_index=experience.sample_index[r],
        ))
    return rows


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``model`` that training changes, under the base checkpoint's names, for ``UpdateWeights``.

    A PEFT LoRA model: each adapted layer's merged weight ``W + (alpha / r) B A`` (every active adapter), named
    as in the base checkpoint (``model.layers.0.self_attn.q_proj.weight``), and the ``modules_to_save`` copies;
    the frozen rest never changes and is not sent. Any other model: its trainable parameters (a DDP ``module.``
    prefix removed). Tensors keep the trainer's dtype (the services cast them to their own).

    Raises:
        NotImplementedError: a PEFT model without LoRA layers (other adapter types cannot be merged here).
    """
    if hasattr(model, "peft_config"):
        yield from _merged_lora_weights(model)
        return
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            yield _checkpoint_name(name), parameter.detach()


def _merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.lora import LoraLayer

    found = False
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                found = True
                weight = module.get_base_layer().weight
                if not module.merged:  # merged adapters are in the base weight already
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A:
                            weight = weight + module.get_delta_weight(adapter)
                yield f"{_checkpoint_name(name)}.weight", weight.detach()
        for name, parameter in model.named_parameters():
            if ".modules_to_save." in name and parameter.requires_grad:
                yield _checkpoint_name(name), parameter.detach()
    if not found:
        raise NotImplementedError("policy_weights merges LoRA adapters only; this PEFT model has no LoRA layer")


def _checkpoint_name(name: str) -> str:
    """A parameter's name in the base checkpoint: without DDP's ``module.``, gradient checkpointing's wrapper,
    PEFT's ``base_model.model.`` / ``.base_layer`` and ``modules_to_save.<adapter>.``."""
    name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if ".modules_to_save." in name:
        head, _, tail = name.partition(".modules_to_save.")
        name = f"{head}.{tail.partition('.')[2]}"
    return name


class ReferenceTable:
    """References and labels of a dataset's rows, looked up by prompt (TRL hands a rollout function only prompts).

    ``dataset``: rows as mappings (a ``datasets.Dataset``, a list of dicts) with a ``prompt_column`` (text or chat
    messages), and optionally ``reference_column`` and ``label_column`` (values sent as text). A prompt that occurs
    in several rows takes the first row's.
    """

    def __init__(self, dataset: Iterable[Mapping[str, Any]], *, prompt_column: str = "prompt",
                 reference_column: str | None = "answer", label_column: str | None = None) -> None:
        self._rows: dict[str, tuple[str | None, str | None]] = {}
        self.reference_column, self.label_column = reference_column, label_column
        for row in dataset:
            reference = row.get(reference_column) if reference_column else None
            label = row.get(label_column) if label_column else None
            self._rows.setdefault(_prompt_key(row[prompt_column]), (
                None if reference is None else str(reference), None if label is None else str(label)))

    def columns(self, prompts: Sequence[PromptLike]) -> dict[str, list[str] | None]:
        """``references`` and ``labels`` for ``prompts`` (``None`` for a column the table does not have), as
        :meth:`ExperienceClient.make_experiences` takes them.

        Raises:
            KeyError: a prompt that is in none of the dataset's rows.
        """
        found = []
        for prompt in prompts:
            key = _prompt_key(prompt)
            if key not in self._rows:
                raise KeyError(f"prompt not in the rollout's dataset (pass the dataset it comes from): {key[:200]}")
            found.append(self._rows[key])
        return {
            "references": [r or "" for r, _ in found] if self.reference_column else None,
            "labels": [label or "" for _, label in found] if self.label_column else None,
        }


def _prompt_key(prompt: PromptLike) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt), sort_keys=True, ensure_ascii=False)


# --- synchronous GRPO: GRPOTrainer(rollout_func=FastexpRollout(...), reward_funcs=[fastexp_reward]) -----------


class RolloutCall(NamedTuple):
    """What one call of :class:`FastexpRollout` did (``FastexpRollout.calls`` keeps them, oldest first)."""

    global_step: int  # the trainer's step when called
    pushed_policy_version: int | None  # the version an UpdateWeights made live before sampling (None: no push)
    policy_versions: tuple[int, ...]  # (B,) versions that sampled the returned rows, in the slice's order
    num_rows: int
    update_s: float  # seconds spent pushing weights
    rollout_s: float  # seconds from the request to the last row


class FastexpRollout:
    """A ``GRPOTrainer`` ``rollout_func`` that takes the rollouts from a fastexp experience service.

    Called as ``rollout(prompts, trainer)`` with the process's prompt slice (each prompt repeated
    ``num_generations`` times in a row by TRL's sampler; chat messages kept, the service applies the model's chat
    template). Each run of repeats is sent once with ``n_samples_per_prompt`` = its length; the completions come back
    in the slice's order.

    Args:
        address: the experience service, ``host:port``.
        options: request options. ``None``: built from the trainer's ``GRPOConfig`` on each call (``temperature``,
            ``top_p``, ``top_k``, ``max_completion_length``) and asking only for what TRL uses: no actor forward
            (``skip_actor_forward``), no reference forward (``kl_coef=0``), one batch per call. Given: used as is,
            but for ``n_samples_per_prompt`` (each run's length) and ``return_packed`` (False).
        dataset: rows with a ``prompt`` column from which references and labels are looked up by prompt
            (see :class:`ReferenceTable`); ``None``: prompts are sent without references.
        reference_column, label_column: the dataset's columns sent as each prompt's reference and label.
        sync_weights: push the trainer's weights (:func:`policy_weights`) through ``UpdateWeights`` whenever the
            trainer's ``global_step`` advanced since the last push, before sampling.
        tls, token, timeout_s: as :class:`~fastexp.client.ExperienceClient` takes them (``token``: an admin token
            when ``sync_weights``).

    The returned dict holds, per completion in the slice's order, ``prompt_ids``, ``completion_ids`` and
    ``logprobs`` (the generator's, which TRL's vLLM importance-sampling correction compares with its own), and as
    extra fields handed to the reward functions ``reward`` (the scorer's), ``reward_metrics`` (its per-source
    metrics) and ``policy_version``; with ``options.environment`` (multi-turn episodes) also ``env_mask``.

    Raises (on call):
        KeyError: a prompt missing from ``dataset``.
        grpc.RpcError: from the service (INVALID_ARGUMENT naming the field, UNAVAILABLE, ...).
    """

    def __init__(
        self,
        address: str,
        options: RequestOptions | None = None,
        *,
        dataset: Iterable[Mapping[str, Any]] | None = None,
        reference_column: str = "answer",
        label_column: str | None = None,
        sync_weights: bool = True,
        tls: ClientTLS | None = None,
        token: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.options = options
        self.sync_weights = sync_weights
        self.references = (ReferenceTable(dataset, reference_column=reference_column, label_column=label_column)
                           if dataset is not None else None)
        self.client = ExperienceClient(address, timeout_s=timeout_s, tls=tls, token=token)
        self.calls: list[RolloutCall] = []
        self._synced_step = 0  # the step whose weights the generator has (a fresh run starts from the same model)

    def __call__(self, prompts: list[PromptLike], trainer: Any) -> dict[str, list]:
        started = time.monotonic()
        step = int(trainer.state.global_step)
        pushed = self._push_weights(trainer, step) if self.sync_weights and step != self._synced_step else None
        updated = time.monotonic()
        rows: list[RolloutRow | None] = [None] * len(prompts)
        runs = prompt_runs(prompts)
        for length in dict.fromkeys(length for _, length in runs):  # one request per group size (usually one)
            starts = [start for start, run in runs if run == length]
            group_prompts = [prompts[start] for start in starts]
            columns = self.references.columns(group_prompts) if self.references is not None else {}
            options = self._options(trainer, n=length, rows=len(starts) * length)
            for experience in self.client.make_experiences(group_prompts, options, **columns):
                for row in experience_rows(experience):
                    rows[starts[row.prompt_index] + row.sample_index] = row
        missing = [i for i, row in enumerate(rows) if row is None]
        if missing:  # the service streams every group exactly once; say so loudly if that ever breaks
            raise RuntimeError(f"the experience stream ended without completions for slice rows {missing}")
        self.calls.append(RolloutCall(step, pushed, tuple(r.policy_version for r in rows), len(rows),
                                      updated - started, time.monotonic() - updated))
        output: dict[str, list] = {
            "prompt_ids": [r.prompt_ids for r in rows],
            "completion_ids": [r.completion_ids for r in rows],
            "logprobs": [r.logprobs for r in rows],
            "reward": [r.reward for r in rows],
            "reward_metrics": [r.reward_metrics for r in rows],
            "policy_version": [r.policy_version for r in rows],
        }
        if self._episodic():
            output["env_mask"] = [r.env_mask for r in rows]
        return output

    def _options(self, trainer: Any, n: int, rows: int) -> RequestOptions:
        if self.options is not None:
            return dataclasses.replace(self.options, n_samples_per_prompt=n, return_packed=False)
        args = trainer.args
        sampling = Sampling(temperature=float(args.temperature), top_p=float(args.top_p),
                            top_k=int(args.top_k or 0), max_new_tokens=int(args.max_completion_length))
        # TRL computes its own advantages: the cheapest estimator that takes any group size; no KL, no actor.
        return RequestOptions(n_samples_per_prompt=n, sampling=sampling, advantage_estimator="reinforce",
                              kl_coef=0.0, skip_actor_forward=True, micro_rollout_batch_size=rows)

    def _episodic(self) -> bool:
        return self.options is not None and bool(self.options.environment)

    def _push_weights(self, trainer: Any, step: int) -> int | None:
        """Push the trainer's current weights (main process), then let every process go on once they are live."""
        accelerator = trainer.accelerator
        version = None
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(trainer.model)
            version = int(self.client.update_weights(policy_weights(model)).policy_version)
            logger.info("step %d: pushed the policy's weights, policy version %d is live", step, version)
        accelerator.wait_for_everyone()
        self._synced_step = step
        return version

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> FastexpRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fastexp_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """A TRL reward function: the scorer's reward of each completion, as :class:`FastexpRollout` returned it
    (``reward_funcs=[fastexp_reward]``: TRL trains on the reward team's scores).

    Shape: (B,) floats, one per completion.

    Raises:
        KeyError: no ``reward`` field (the trainer's ``rollout_func`` is not a :class:`FastexpRollout`).
    """
    if "reward" not in kwargs:
        raise KeyError("fastexp_reward reads the 'reward' field FastexpRollout returns: pass rollout_func=FastexpRollout(...)")
    rewards = [float(reward) for reward in kwargs["reward"]]
    if len(rewards) != len(completions):
        raise ValueError(f"{len(rewards)} rewards for {len(completions)} completions")
    return rewards


# --- asynchronous GRPO: TRL's RolloutWorkerProtocol and WeightTransferProtocol ---------------------------------


class FastexpWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over fastexp's ``UpdateWeights``: the generator and the experience service's
    actor replica switch to the streamed weights together, under a new policy version.

    ``pause``/``resume`` do nothing: an update is applied between engine steps, and generations in flight across
    it follow the request's ``partial_rollout`` (finish under the old weights, or resample).

    Args:
        address, tls, token: the experience service, as :class:`~fastexp.client.ExperienceClient` takes them.
        chunk_bytes: bytes per streamed chunk. timeout_s: deadline of one update, seconds.
        ready_timeout_s: how long ``init_weight_transfer`` waits for the service to be SERVING.
    """

    def __init__(self, address: str, *, tls: ClientTLS | None = None, token: str | None = None,
                 chunk_bytes: int = 4 * 1024 * 1024, timeout_s: float = 600.0, ready_timeout_s: float = 600.0) -> None:
        self.client = ExperienceClient(address, tls=tls, token=token)
        self.chunk_bytes, self.timeout_s, self.ready_timeout_s = chunk_bytes, timeout_s, ready_timeout_s
        #: The policy version the last ``send_weights`` made live (None before the first).
        self.policy_version: int | None = None
        #: Tensors and bytes of the last update, and its seconds.
        self.last_update: dict[str, float] = {}

    def init_weight_transfer(self) -> None:
        """Wait until the service is SERVING. Raises TimeoutError when it is not within ``ready_timeout_s``."""
        self.client.wait_until_ready(self.ready_timeout_s)

    def pause(self) -> None:
        """Nothing to pause (see the class)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream ``(name, tensor)`` pairs (base checkpoint names) and return once they are live.

        Raises:
            grpc.RpcError: INVALID_ARGUMENT naming a bad tensor (nothing applied), RESOURCE_EXHAUSTED while another
                update runs, UNAVAILABLE, DEADLINE_EXCEEDED.
        """
        started = time.monotonic()
        response = self.client.update_weights(iterator, chunk_bytes=self.chunk_bytes, timeout_s=self.timeout_s)
        self.policy_version = int(response.policy_version)
        self.last_update = {"num_tensors": float(response.num_tensors), "num_bytes": float(response.num_bytes),
                            "seconds": time.monotonic() - started}

    def resume(self) -> None:
        """Nothing to resume (see the class)."""

    def destroy(self) -> None:
        self.client.close()


class FastexpRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` fed by ``MakeExperiences``: a thread streams experiences for the dataset's
    prompts (in order, ``prompts_per_request`` per request, over and over) and puts one TRL ``RolloutSample`` per
    row on ``rollout_buffer``.

    A sample's ``input_ids`` (P + C,) int64 are the prompt and completion, ``completion_mask`` (P + C,) int64 is 1
    on the tokens the model sampled, ``old_log_probs`` (P + C,) float32 are the generator's log-probs there (0 on
    the prompt and observations), ``advantage`` is fastexp's (``options.advantage_estimator``; with the defaults'
    outcome rewards and no KL penalty it is the same on every token of a row), ``model_version`` is the trainer's
    version of the weights that sampled it and ``metrics`` hold ``reward``, ``reward_std`` (over its group) and
    ``rewards/<name>`` per scorer metric.

    Versions: the trainer counts its own (``update_model_version``); with ``weight_transfer`` the worker maps the
    fastexp policy version each transfer made live to the trainer's version announced after it, so a row sampled
    by fastexp version p carries the trainer version of the newest transfer at or before p (0 before any). Without
    it, the fastexp version is used as it is.

    Args:
        address, tls, token: the experience service.
        dataset: rows with ``prompt_column`` (text or chat messages) and optionally ``reference_column`` and
            ``label_column``.
        options: request options; ``None``: 8 samples per prompt, ``group_norm``, no KL, no actor forward,
            ``max_staleness`` 1. ``return_packed`` is always False.
        prompts_per_request: prompts per ``MakeExperiences`` stream. epochs: passes over the dataset (None: no end).
        queue_maxsize: bound of ``rollout_buffer`` (0: unbounded); a full buffer stops reading the stream, which
            stops the service's generation (its backpressure).
    """

    def __init__(
        self,
        address: str,
        dataset: Sequence[Mapping[str, Any]],
        options: RequestOptions | None = None,
        *,
        prompt_column: str = "prompt",
        reference_column: str | None = "answer",
        label_column: str | None = None,
        prompts_per_request: int = 16,
        epochs: int | None = None,
        queue_maxsize: int = 0,
        weight_transfer: FastexpWeightTransfer | None = None,
        tls: ClientTLS | None = None,
        token: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self.options = dataclasses.replace(options if options is not None else RequestOptions(
            n_samples_per_prompt=8, advantage_estimator="group_norm", kl_coef=0.0, skip_actor_forward=True,
            max_staleness=1), return_packed=False)
        self.prompts = [row[prompt_column] for row in dataset]
        self.references = ReferenceTable(dataset, prompt_column=prompt_column, reference_column=reference_column,
                                         label_column=label_column)
        self.prompts_per_request, self.epochs = prompts_per_request, epochs
        self.weight_transfer = weight_transfer
        self.model_version = 0
        self._address, self._tls, self._token, self._timeout_s = address, tls, token, timeout_s
        self._versions: dict[int, int] = {}  # fastexp policy version -> the trainer's model version
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: ExperienceClient | None = None
        self._heartbeat = 0.0
        self._failure: BaseException | None = None
        self._finished = False  # every request of every epoch was streamed
        self._next_group_id = 0

    def start(self) -> None:
        """Start streaming (once; a second call is ignored)."""
        if self._thread is not None:
            logger.warning("FastexpRolloutWorker.start() called while running; ignored")
            return
        importlib.import_module("trl.experimental.async_grpo.async_rollout_worker")  # no TRL: fail here, not later
        self._stop.clear()
        self._heartbeat = time.time()
        self._client = ExperienceClient(self._address, timeout_s=self._timeout_s, tls=self._tls, token=self._token)
        self._thread = threading.Thread(target=self._run, name="fastexp-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop streaming: the open stream is cancelled (its generation aborted) and the thread joined."""
        self._stop.set()
        if self._client is not None:
            self._client.close()
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._thread = self._client = None

    def update_model_version(self, model_version: int) -> None:
        """The trainer's policy version now live (called after each weight transfer)."""
        with self._lock:
            self.model_version = int(model_version)
            live = self.weight_transfer.policy_version if self.weight_transfer is not None else None
            if live is not None:
                self._versions[live] = self.model_version

    def check_health(self, stale_after_s: float) -> None:
        """Raise RuntimeError if the thread failed (chained to its error), ended early, or produced nothing for
        ``stale_after_s`` seconds (a row or a wait on a full buffer counts)."""
        if self._failure is not None:
            raise RuntimeError("the fastexp rollout worker failed; see the chained error") from self._failure
        if self._thread is not None and not self._thread.is_alive() and not self._finished:
            raise RuntimeError("the fastexp rollout worker's thread ended")
        age = time.time() - self._heartbeat
        if self._thread is not None and age > stale_after_s:
            raise RuntimeError(f"the fastexp rollout worker produced nothing for {age:.0f} s > {stale_after_s:.0f} s")

    def trainer_version(self, policy_version: int) -> int:
        """The trainer's model version of fastexp's ``policy_version`` (see the class)."""
        with self._lock:
            if self.weight_transfer is None:
                return policy_version
            known = [p for p in self._versions if p <= policy_version]
            return self._versions[max(known)] if known else 0

    def _requests(self) -> Iterator[list[int]]:
        """Prompt indices of each request, in dataset order, ``epochs`` times (forever when None)."""
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            for start in range(0, len(self.prompts), self.prompts_per_request):
                yield list(range(start, min(start + self.prompts_per_request, len(self.prompts))))
            epoch += 1

    def _run(self) -> None:
        try:
            for indices in self._requests():
                if self._stop.is_set():
                    return
                prompts = [self.prompts[i] for i in indices]
                started = time.monotonic()
                group_ids: dict[int, int] = {}
                for experience in self._client.make_experiences(prompts, self.options,
                                                                **self.references.columns(prompts)):
                    self._heartbeat = time.time()
                    samples = self._samples(experience, prompts, group_ids)
                    waited = self._put(samples)
                    if waited is None:
                        return
                    self._metric({"fastexp/policy_version": float(max(experience.policy_version)),
                                  "fastexp/rows_per_batch": float(len(samples)),
                                  "rollout/backpressure_s": waited})
                self._metric({"fastexp/request_s": time.monotonic() - started})
            self._finished = True
        except grpc.RpcError as error:
            if not self._stop.is_set():
                self._failure = error
        except BaseException as error:  # surfaced by check_health on the trainer's side
            self._failure = error

    def _samples(self, experience: Experience, prompts: list[PromptLike], group_ids: dict[int, int]) -> list:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        rows = experience_rows(experience)
        rewards: dict[int, list[float]] = {}
        for row in rows:
            rewards.setdefault(row.prompt_index, []).append(row.reward)
        samples = []
        for row in rows:
            if row.prompt_index not in group_ids:
                group_ids[row.prompt_index] = self._next_group_id
                self._next_group_id += 1
            prompt = prompts[row.prompt_index]
            completion = row.response_text if isinstance(prompt, str) else [
                {"role": "assistant", "content": row.response_text}]
            context = len(row.prompt_ids)
            samples.append(RolloutSample(
                prompt=prompt,
                completion=completion,
                input_ids=np.asarray(row.prompt_ids + row.completion_ids, dtype=np.int64),
                completion_mask=np.asarray([0] * context + row.env_mask, dtype=np.int64),
                old_log_probs=np.asarray([0.0] * context + row.logprobs, dtype=np.float32),
                advantage=row.advantage,
                model_version=self.trainer_version(row.policy_version),
                group_id=group_ids[row.prompt_index],
                metrics={"reward": row.reward, "reward_std": float(np.std(rewards[row.prompt_index])),
                         **{f"rewards/{name}": value for name, value in row.reward_metrics.items()}},
            ))
        return samples

    def _put(self, samples: list) -> float | None:
        """Put ``samples`` on the buffer, waiting while it is full; the seconds waited, None when stopped."""
        waited_since = None
        for sample in samples:
            while True:
                sample.enqueued_at = time.time()
                try:
                    self.rollout_buffer.put(sample, timeout=0.1)
                    break
                except queue.Full:
                    if self._stop.is_set():
                        return None
                    waited_since = waited_since or time.monotonic()
                    self._heartbeat = time.time()  # waiting for the trainer is not a hang
        return time.monotonic() - waited_since if waited_since is not None else 0.0

    def _metric(self, values: dict[str, float]) -> None:
        with contextlib.suppress(queue.Full):  # a trainer that stops draining never blocks the rollouts
            self.metrics_queue.put_nowait(values)

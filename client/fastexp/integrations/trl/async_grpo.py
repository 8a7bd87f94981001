"""Asynchronous GRPO: TRL's ``RolloutWorkerProtocol`` and ``WeightTransferProtocol``
(``trl.experimental.async_grpo``) over ``MakeExperiences`` and ``UpdateWeights``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastexp.client import ExperienceClient
from fastexp.integrations.trl.rows import ReferenceTable, experience_rows
from fastexp.request import PromptLike, RequestOptions
from fastexp.security import ClientTLS
from fastexp.types import Experience

logger = logging.getLogger(__name__)


class FastexpWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over fastexp's ``UpdateWeights``: the generator and the experience service's
    actor replica switch to the streamed weights together, under a new policy version.

    ``pause``/``resume`` do nothing: an update is applied between engine steps, and generations in flight across
    it follow the request's ``partial_rollout`` (finish under the old weights, or resample).

    Args:
        address: the experience service, as :class:`~fastexp.client.ExperienceClient` takes it.
        tls: as :class:`~fastexp.client.ExperienceClient` takes it.
        token: as :class:`~fastexp.client.ExperienceClient` takes it.
        chunk_bytes: bytes per streamed chunk.
        timeout_s: deadline of one update, seconds.
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
        address: the experience service.
        tls: as :class:`~fastexp.client.ExperienceClient` takes it.
        token: as :class:`~fastexp.client.ExperienceClient` takes it.
        dataset: rows with ``prompt_column`` (text or chat messages) and optionally ``reference_column`` and
            ``label_column``.
        options: request options; ``None``: 8 samples per prompt, ``group_norm``, no KL, no actor forward,
            ``max_staleness`` 1. ``return_packed`` is always False.
        prompts_per_request: prompts per ``MakeExperiences`` stream.
        epochs: passes over the dataset (None: no end).
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
        except BaseException as error:  # surfaced by check_health on the trainer's side
            if not self._stop.is_set():  # stopping closes the channel under the stream: not a failure
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

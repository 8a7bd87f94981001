"""Synchronous GRPO: ``GRPOTrainer(rollout_func=FastexpRollout(...), reward_funcs=[fastexp_reward])``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from fastexp.client import ExperienceClient
from fastexp.integrations.trl.lora_runs import adapter_tensors, ensure_run, lora_config, run_spec
from fastexp.integrations.trl.rows import ReferenceTable, RolloutRow, experience_rows, policy_weights, prompt_runs
from fastexp.request import PromptLike, RequestOptions, Sampling
from fastexp.security import ClientTLS

logger = logging.getLogger(__name__)


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
        reference_column: the dataset's column sent as each prompt's reference.
        label_column: the dataset's column sent as each prompt's label.
        sync_weights: push the trainer's weights (:func:`policy_weights`) through ``UpdateWeights`` whenever the
            trainer's ``global_step`` advanced since the last push, before sampling.
        tls: as :class:`~fastexp.client.ExperienceClient` takes it.
        token: as :class:`~fastexp.client.ExperienceClient` takes it (an admin token when ``sync_weights``
            without ``run_id``; with it, the run's owner's token).
        timeout_s: as :class:`~fastexp.client.ExperienceClient` takes it.
        run_id: train the trainer's peft LoRA adapter as this fastexp *LoRA run* (docs/trainer/runs.md) instead of
            the deployment's base model. With ``sync_weights``, its first call finds the token's run of this id
            or creates it from the adapter's ``LoraConfig`` (``r``, ``lora_alpha``, sorted ``target_modules``),
            and it pushes the adapter itself, not merged weights
            (:func:`~fastexp.integrations.trl.lora_runs.adapter_tensors`: peft's ``get_peft_model_state_dict``
            of adapter ``"default"``, with ``update_weights(run_id=...)``), before its first sampling (a new run
            has no adapter and streams nothing before one) and whenever ``global_step`` advanced; its streams
            carry ``run_id`` (which wins over ``options.run_id``), and each row's ``policy_version`` is the run's
            own adapter version (1, 2, ...: other runs' updates do not count).

    The returned dict holds, per completion in the slice's order, ``prompt_ids``, ``completion_ids`` and
    ``logprobs`` (the generator's, which TRL's vLLM importance-sampling correction compares with its own), and as
    extra fields handed to the reward functions ``reward`` (the scorer's), ``reward_metrics`` (its per-source
    metrics) and ``policy_version``; with ``options.environment`` (multi-turn episodes) also ``env_mask``.

    Raises (on call):
        KeyError: a prompt missing from ``dataset``.
        ValueError: with ``run_id``: the trainer's model is not a peft LoRA model, its ``LoraConfig`` is one a
            run cannot express, or the run exists with another adapter shape (or as a base-model run).
        grpc.RpcError: from the service (INVALID_ARGUMENT naming the field, UNAVAILABLE, PERMISSION_DENIED for
            another token's run, ...).
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
        run_id: str | None = None,
    ) -> None:
        self.options = options
        self.sync_weights = sync_weights
        self.run_id = run_id
        self.references = (ReferenceTable(dataset, reference_column=reference_column, label_column=label_column)
                           if dataset is not None else None)
        self.client = ExperienceClient(address, timeout_s=timeout_s, tls=tls, token=token)
        self.calls: list[RolloutCall] = []
        # the step whose weights the generator has (a fresh run starts from the same model; a LoRA run has none)
        self._synced_step: int | None = None if run_id else 0

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
            options = dataclasses.replace(self.options, n_samples_per_prompt=n, return_packed=False)
        else:
            args = trainer.args
            sampling = Sampling(temperature=float(args.temperature), top_p=float(args.top_p),
                                top_k=int(args.top_k or 0), max_new_tokens=int(args.max_completion_length))
            # TRL computes its own advantages: the cheapest estimator that takes any group size; no KL, no actor.
            options = RequestOptions(n_samples_per_prompt=n, sampling=sampling, advantage_estimator="reinforce",
                                     kl_coef=0.0, skip_actor_forward=True, micro_rollout_batch_size=rows)
        return dataclasses.replace(options, run_id=self.run_id) if self.run_id else options

    def _episodic(self) -> bool:
        return self.options is not None and bool(self.options.environment)

    def _push_weights(self, trainer: Any, step: int) -> int | None:
        """Push the trainer's current weights (main process), then let every process go on once they are live:
        merged weights of the base policy, or with ``run_id`` the adapter (the run found or created first)."""
        accelerator = trainer.accelerator
        version = None
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(trainer.model)
            if self.run_id:
                if self._synced_step is None:  # the first push: the run must exist, with this adapter's shape
                    ensure_run(self.client, self.run_id, run_spec(lora_config(model)))
                tensors = adapter_tensors(model)
            else:
                tensors = policy_weights(model)
            version = int(self.client.update_weights(tensors, run_id=self.run_id).policy_version)
            logger.info("step %d: pushed the policy's %s, policy version %d is live", step,
                        f"adapter (run {self.run_id})" if self.run_id else "weights", version)
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

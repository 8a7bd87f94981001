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

A LoRA policy can train as its own *LoRA run* on a shared deployment (docs/trainer/runs.md), beside other trainers'
runs: ``FastexpRollout(address, dataset=train_dataset, token=token, run_id="alice-lora")`` creates the run from the
trainer's ``LoraConfig`` and pushes the adapter itself (:func:`adapter_tensors`) instead of merged weights; each row's
``policy_version`` is then the run's own adapter version.

Asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, which needs CUDA kernels)::

    transfer = FastexpWeightTransfer("127.0.0.1:50053")
    worker = FastexpRolloutWorker("127.0.0.1:50053", train_dataset, options, weight_transfer=transfer)
    trainer = AsyncGRPOTrainer(..., rollout_worker=worker, weight_transfer=transfer)

There the rows carry fastexp's advantages (``options.advantage_estimator``), and ``options.max_staleness`` bounds
how many policy versions behind a row may be when it is streamed.

Notation: B rows, P a row's prompt tokens, C its completion tokens (a multi-turn episode's completion holds its
model turns and the environment's observations between them).
"""

from fastexp.integrations.trl.async_grpo import FastexpRolloutWorker, FastexpWeightTransfer
from fastexp.integrations.trl.lora_runs import adapter_tensors, ensure_run, lora_config, run_spec
from fastexp.integrations.trl.rollout import FastexpRollout, RolloutCall, fastexp_reward
from fastexp.integrations.trl.rows import ReferenceTable, RolloutRow, experience_rows, policy_weights, prompt_runs

__all__ = [
    "FastexpRollout", "FastexpRolloutWorker", "FastexpWeightTransfer", "ReferenceTable", "RolloutCall", "RolloutRow",
    "adapter_tensors", "ensure_run", "experience_rows", "fastexp_reward", "lora_config", "policy_weights",
    "prompt_runs", "run_spec",
]

"""One TRL GRPO step through fastexp against TRL alone (issue 32): what a TRL user pays, or saves, by taking the
rollouts from the services.

Workload: TRL 1.16.0's ``GRPOTrainer`` on SmolLM2-135M-Instruct (float32, a LoRA adapter of rank 16 on the
attention projections, ``beta`` 0) with reasoning-gym ``basic_arithmetic`` chat prompts, ``num_prompts`` prompts x
``num_generations`` samples per step, temperature 1, up to ``max_completion_length`` tokens, math-verify rewards.

- ``trl_alone``: TRL's own generation (``model.generate`` in the trainer's process, ``use_vllm=False``) and a
  math-verify reward function in process.
- ``through_fastexp``: the same trainer with ``rollout_func=FastexpRollout(...)`` and
  ``reward_funcs=[fastexp_reward]`` against the three services (``LocalCluster`` with the launcher's default core
  split, the generator on ``backend``: vLLM); with ``lora_run`` (the default) the trainer's adapter trains as a
  LoRA run (``run_id``), so each step pushes the adapter (``UpdateWeights(run_id=...)``, 4 projections x rank 16:
  7.4 MB of float32) before its rollout, otherwise the merged weights of the whole model (538 MB).

A step's time is the wall time from TRL's ``on_step_begin`` to ``on_step_end`` (rollout, rewards, log-probs,
backward, optimizer); the first ``warmup_steps`` are left out. Figure: ``trl_fastexp_step_vs_trl_alone`` = median
step time through fastexp / median step time alone (< 1: fastexp's step is faster; medians, because single steps
on a shared CPU host swing several-fold), with the means, each run's step times,
rollout and weight-push seconds and rewards in ``trl_step_inputs``. On one CPU host the services and the trainer
share the cores, so the figure says what the network path costs, not what a separate generator machine saves.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrlStepWorkload:
    """The steps both runs train."""

    task: str = "basic_arithmetic"
    num_prompts: int = 2
    num_generations: int = 4
    max_completion_length: int = 64
    steps: int = 6
    warmup_steps: int = 1
    lora_rank: int = 16
    backend: str = "vllm"
    lora_run: bool = True
    seed: int = 0


def run(model: str, workload: TrlStepWorkload, log_dir: Path) -> dict:
    """Train ``workload.steps`` steps each way on ``model`` (a local folder); returns the figure and its inputs."""
    from fastexp.integrations.trl import FastexpRollout, fastexp_reward
    from services.launcher import LocalCluster, fresh_state_dir

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    alone = _train(model, workload, log_dir / "trl_alone", reward_funcs=[_math_verify_reward])
    overrides = {"generator": {"model": model, "backend": workload.backend, "max_model_len": 1024},
                 "experience": {"actor_model": model, "reference_model": model}}
    with LocalCluster(overrides=overrides, log_dir=log_dir / "trl_fastexp",
                      state_dir=fresh_state_dir(log_dir / "trl_fastexp-state")) as cluster, \
            FastexpRollout(cluster.address("experience"), dataset=_dataset(workload),
                           run_id="trl-step" if workload.lora_run else None) as rollout:
        through = _train(model, workload, log_dir / "trl_fastexp", reward_funcs=[fastexp_reward],
                         rollout_func=rollout)
        through["rollout_s"] = [round(call.rollout_s, 3) for call in rollout.calls]
        through["update_s"] = [round(call.update_s, 3) for call in rollout.calls]
        through["policy_versions"] = [max(call.policy_versions) for call in rollout.calls]
    return {
        "trl_fastexp_step_vs_trl_alone": through["median_step_s"] / alone["median_step_s"],
        "trl_fastexp_step_vs_trl_alone_means": through["mean_step_s"] / alone["mean_step_s"],
        "trl_step_inputs": {"trl_alone": alone, "through_fastexp": through, "workload": asdict(workload)},
    }


def _dataset(workload: TrlStepWorkload):
    import datasets

    from services.demo.datasets import task_problems

    problems = task_problems(workload.task, workload.steps * workload.num_prompts, seed=workload.seed)
    return datasets.Dataset.from_list([{"prompt": list(p.messages), "answer": p.reference} for p in problems])


def _math_verify_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """The scorer's default rule (math-verify against the reference), called in the trainer's process."""
    from services.scorer.rules import math_verify_reward

    return [math_verify_reward(c[0]["content"], reference)[0] for c, reference in zip(completions, answer, strict=True)]


def _train(model: str, workload: TrlStepWorkload, out: Path, **trainer_arguments) -> dict:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._started)

    clock = StepClock()
    args = GRPOConfig(
        output_dir=str(out), max_steps=workload.steps, num_generations=workload.num_generations,
        per_device_train_batch_size=workload.num_prompts * workload.num_generations,
        max_completion_length=workload.max_completion_length, temperature=1.0, beta=0.0, bf16=False, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=workload.seed, disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype="float32"),
        processing_class=AutoTokenizer.from_pretrained(model), args=args, train_dataset=_dataset(workload),
        peft_config=LoraConfig(r=workload.lora_rank, lora_alpha=2 * workload.lora_rank, lora_dropout=0.0,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        callbacks=[clock], **trainer_arguments,
    )
    trainer.train()
    measured = clock.seconds[workload.warmup_steps:]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "median_step_s": statistics.median(measured), "mean_step_s": statistics.mean(measured),
        "step_s": [round(s, 3) for s in clock.seconds],
        "reward_mean": [round(h["reward"], 4) for h in logs],
        "completion_length_mean": [h["completions/mean_length"] for h in logs],
    }


def main(out: Path = Path("out/bench")) -> None:
    """``python -m benchmarks.trl_step``: this figure alone, written to ``<out>/trl_step.json``."""
    import json

    from services.common.models import SMOLLM2_ALIAS, resolve_model

    results = run(resolve_model(SMOLLM2_ALIAS), TrlStepWorkload(), out / "logs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "trl_step.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""TRL's GRPOTrainer, unchanged, with its rollouts from fastexp: SmolLM2-135M-Instruct on basic_arithmetic.

The embedded default model (SmolLM2-135M-Instruct) learns two-term one-digit arithmetic (reasoning-gym
``basic_arithmetic``, "Put the final answer in \\boxed{}.") with TRL's ``GRPOTrainer`` and a LoRA adapter on the
CPU. Two arguments make TRL train through fastexp::

    GRPOTrainer(..., rollout_func=FastexpRollout(address, dataset=train), reward_funcs=[fastexp_reward])

Each step, ``FastexpRollout`` pushes the adapter's merged weights (``UpdateWeights``) when the step advanced, sends
the step's prompts to ``MakeExperiences`` once per group, and hands TRL the generator's token ids and log-probs and
the scorer's math-verify rewards; TRL computes its advantages, log-probs and loss as always.

Run (starts the three services itself; about half a minute per step on 2 CPU cores with the HF backend)::

    .venv/bin/python examples/trl_grpo.py --steps 8 --out out/trl_grpo

Writes ``<out>/metrics.jsonl`` (per step: the reward, the policy version that sampled the step's rows, seconds
pushing weights and sampling, and the whole step: TRL's ``step_time``, rollout included),
``<out>/reward_curve.png`` and the services' logs in ``<out>/logs``; prints the reward curve.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from fastexp.integrations.trl import FastexpRollout, fastexp_reward
from services.common.models import resolve_model
from services.demo.datasets import task_problems
from services.launcher import LocalCluster, fresh_state_dir

logger = logging.getLogger("trl_grpo")
TASK = "basic_arithmetic"


def main(
    steps: int = typer.Option(8, help="GRPO steps (one rollout and one optimizer step each)"),
    prompts_per_step: int = typer.Option(4, help="problems per step"),
    num_generations: int = typer.Option(8, help="GRPO group size"),
    max_completion_length: int = typer.Option(96, help="most tokens per answer"),
    learning_rate: float = typer.Option(2e-4, help="AdamW learning rate of the LoRA adapter"),
    lora_rank: int = typer.Option(16, help="LoRA rank"),
    backend: str = typer.Option("hf", help="generator backend: hf, vllm or auto"),
    seed: int = typer.Option(0, help="problems' and trainer's seed"),
    out: Path = typer.Option("out/trl_grpo", help="output folder"),  # noqa: B008 - typer converts the str
) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model("smollm2-135m-instruct")
    problems = task_problems(TASK, steps * prompts_per_step, seed=seed)
    train = datasets.Dataset.from_list([{"prompt": list(p.messages), "answer": p.reference} for p in problems])
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations, max_completion_length=max_completion_length, temperature=1.0,
        learning_rate=learning_rate, beta=0.0, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=seed, disable_tqdm=True,
    )
    overrides = {"generator": {"model": model_path, "backend": backend, "max_model_len": 1024},
                 "experience": {"actor_model": model_path, "reference_model": model_path}}
    with LocalCluster(overrides=overrides, log_dir=out / "logs", state_dir=fresh_state_dir(out / "state")) as cluster, \
            FastexpRollout(cluster.address("experience"), dataset=train) as rollout:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_path, dtype="float32"),
            processing_class=AutoTokenizer.from_pretrained(model_path),
            args=args, train_dataset=train, peft_config=LoraConfig(
                r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            rollout_func=rollout, reward_funcs=[fastexp_reward],
        )
        trainer.train()
    curve = [
        {"step": i + 1, "reward_mean": log["reward"], "reward_std": log["reward_std"],
         "completion_length_mean": log["completions/mean_length"], "policy_version_sampled": max(call.policy_versions),
         "update_s": call.update_s, "rollout_s": call.rollout_s, "step_s": log.get("step_time")}
        for i, (log, call) in enumerate(zip([h for h in trainer.state.log_history if "reward" in h], rollout.calls,
                                            strict=True))
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in curve))
    plot(curve, out / "reward_curve.png")
    print("step  reward  policy_version  rollout_s  step_s")  # step_s: TRL's step_time, the rollout included
    for row in curve:
        print(f"{row['step']:>4}  {row['reward_mean']:.3f}  {row['policy_version_sampled']:>14}  "
              f"{row['rollout_s']:>9.1f}  {row['step_s'] or 0:>6.1f}")


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in curve]
    axis.plot(steps, [r["reward_mean"] for r in curve], marker="o", label="math-verify reward (T=1)")
    axis.set_xlabel("TRL step (the rows of step k come from policy version k - 1)")
    axis.set_ylabel("scorer reward (mean over the step's rows)")
    axis.set_title(f"TRL GRPOTrainer through fastexp: SmolLM2-135M + LoRA on {TASK}", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":  # vLLM's engine spawns processes: keep the entry point guarded
    typer.run(main)

"""Closed-loop GRPO through the fastexp API: SmolLM2-135M-Instruct learns small-number arithmetic on the CPU.

Each step: ``MakeExperiences`` (the generator samples n answers per problem, the scorer checks them with
math-verify, the experience service returns group-normalized advantages) -> one policy-gradient step on a LoRA
adapter in this process -> ``UpdateWeights`` with the merged attention weights (the generator's engine and the
experience service's actor replica switch to them) -> the next batch is sampled by the new policy. Every
``--eval-every`` steps the greedy accuracy on held-out problems is measured through the same API.

Run (starts the three services itself; about a minute per step on 2 CPU cores)::

    .venv/bin/python examples/grpo_arithmetic.py --steps 20 --out out/grpo

Multi-turn: ``--environment math_feedback --max-turns 3`` makes each sample an episode in the scorer's
``math_feedback`` environment (a wrong answer gets feedback and another try; reward 1 if solved within the turns);
the loss below is unchanged, ``action_mask`` keeps the environment's messages out of it.

Writes ``<out>/metrics.jsonl`` (one line per step and per evaluation), ``<out>/reward_curve.png`` and
``<out>/summary.json`` (held-out accuracy before and after).

The loss is GRPO's (Shao et al. 2024, arXiv 2402.03300) with one gradient step per batch, so the importance
ratio is 1 and its clipping is inactive: ``L = -sum_t A_t * log pi(a_t) * m_t / sum_t m_t`` over the batch's
action tokens, with the experience's ``advantages`` (group-normalized rewards; KL to the reference in the reward
at ``kl_coef``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import typer
from tqdm import tqdm

from fastexp import Experience, ExperienceClient, Sampling
from services.common.models import resolve_model
from services.demo.datasets import Problem, task_problems
from services.launcher import LocalCluster, fresh_state_dir

logger = logging.getLogger("grpo_arithmetic")

#: Two 1-2 digit terms, + and -: the base model answers a third right greedily and 12-20 % when sampling at T = 1
#: (measured; see services.demo.datasets.TASK_PRESETS), so groups of 8 samples carry signal.
TASK = "basic_arithmetic_2digit"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def problems(count: int, seed: int) -> list[Problem]:
    return task_problems(TASK, count, seed=seed)


def experiences(client: ExperienceClient, batch: list[Problem], **options) -> list[Experience]:
    return list(client.make_experiences(
        [list(p.messages) for p in batch], references=[p.reference for p in batch], labels=[p.label for p in batch],
        micro_rollout_batch_size=4096, **options,
    ))


def evaluate(client: ExperienceClient, held_out: list[Problem], max_new_tokens: int) -> float:
    """Greedy accuracy (math-verify reward) on ``held_out``, one sample each."""
    batches = experiences(client, held_out, n_samples_per_prompt=1, advantage_estimator="reinforce",
                          sampling=Sampling(temperature=0.0, max_new_tokens=max_new_tokens))
    return float(torch.cat([e.reward for e in batches]).mean())


def lora_policy(model_path: str, rank: int):
    """The trainer's policy: the base model in float32 with a LoRA adapter on the attention projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(base, config)


def merged_weights(policy) -> list[tuple[str, torch.Tensor]]:
    """The adapted layers' merged weights ``W + (alpha/r) B A`` under the base checkpoint's names, in bfloat16."""
    from peft.tuners.lora import LoraLayer

    merged = []
    with torch.no_grad():
        for name, module in policy.named_modules():
            if isinstance(module, LoraLayer):
                weight = module.base_layer.weight + module.get_delta_weight("default")
                merged.append((f"{name.removeprefix('base_model.model.')}.weight", weight.to(torch.bfloat16)))
    return merged


def accumulate_policy_gradient(policy, experience: Experience, tokens: int, rows_per_pass: int) -> None:
    """Add the gradient of ``-sum(A * log pi * m) / tokens`` over ``experience``'s rows (``tokens``: the step's
    action tokens, so the batches of one step average per token)."""
    mask = experience.action_mask
    width = mask.shape[1]
    for start in range(0, mask.shape[0], rows_per_pass):
        rows = slice(start, start + rows_per_pass)
        logits = policy(input_ids=experience.sequences[rows], attention_mask=experience.attention_mask[rows]).logits
        logits = logits[:, -width - 1 : -1].float()  # the positions that predict the response tokens
        actions = experience.sequences[rows, -width:]
        log_probs = torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        objective = (experience.advantages[rows] * log_probs * mask[rows]).sum()
        (-objective / tokens).backward()


def main(
    steps: int = typer.Option(20, help="training steps (one MakeExperiences batch and one update each)"),
    prompts_per_step: int = typer.Option(12, help="problems per step"),
    n_samples_per_prompt: int = typer.Option(8, help="GRPO group size"),
    max_new_tokens: int = typer.Option(96, help="most tokens per answer"),
    learning_rate: float = typer.Option(2e-4, help="AdamW learning rate of the LoRA adapter"),
    lora_rank: int = typer.Option(16, help="LoRA rank"),
    kl_coef: float = typer.Option(0.01, help="beta of the k1 KL penalty in the reward"),
    eval_size: int = typer.Option(128, help="held-out problems"),
    eval_every: int = typer.Option(5, help="evaluate every this many steps (and after the last)"),
    backend: str = typer.Option("auto", help="generator backend: auto, vllm or hf"),
    rows_per_pass: int = typer.Option(16, help="rows per trainer forward/backward pass"),
    seed: int = typer.Option(0, help="training problems' seed (held-out ones use seed + 10**6)"),
    environment: str = typer.Option("", help="multi-turn episodes in this scorer environment (e.g. math_feedback)"),
    max_turns: int = typer.Option(3, help="model turns per episode (with --environment)"),
    out: Path = typer.Option("out/grpo", help="output folder"),  # noqa: B008 - typer converts the str
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    train = problems(steps * prompts_per_step, seed)
    held_out = problems(eval_size, seed + 10**6)
    model = resolve_model("smollm2-135m-instruct")
    policy = lora_policy(model, lora_rank)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=learning_rate)
    overrides = {
        "generator": {"model": model, "backend": backend, "max_model_len": 1024},
        "experience": {"actor_model": model, "reference_model": model},
    }
    curve: list[dict] = []
    evals: list[dict] = []
    with LocalCluster(overrides=overrides, log_dir=out / "logs", state_dir=fresh_state_dir(out / "state")) as cluster, \
            ExperienceClient(cluster.address("experience"), timeout_s=1800) as client, \
            (out / "metrics.jsonl").open("w") as log:

        def record_eval(step: int) -> None:
            accuracy = evaluate(client, held_out, max_new_tokens)
            evals.append({"step": step, "held_out_accuracy": accuracy})
            log.write(json.dumps(evals[-1]) + "\n")
            log.flush()
            write_results(out, curve, evals, environment)
            tqdm.write(f"step {step}: held-out greedy accuracy {accuracy:.3f}")

        record_eval(0)
        bar = tqdm(range(1, steps + 1), unit="step", desc="GRPO")
        for step in bar:
            started = time.monotonic()
            batch = train[(step - 1) * prompts_per_step : step * prompts_per_step]
            episodes = {"environment": environment, "max_turns": max_turns} if environment else {}
            stream = experiences(client, batch, n_samples_per_prompt=n_samples_per_prompt, kl_coef=kl_coef,
                                 advantage_estimator="group_norm",
                                 sampling=Sampling(temperature=1.0, max_new_tokens=max_new_tokens), **episodes)
            made = time.monotonic()
            optimizer.zero_grad()
            tokens = sum(int(e.action_mask.sum()) for e in stream)
            for experience in stream:
                accumulate_policy_gradient(policy, experience, tokens, rows_per_pass)
            optimizer.step()
            trained = time.monotonic()
            response = client.update_weights(merged_weights(policy))
            reward = torch.cat([e.reward for e in stream])
            mask = torch.cat([e.action_mask.flatten() for e in stream])
            kl = torch.cat([e.kl.flatten() for e in stream])
            row = {
                "step": step,
                "reward_mean": float(reward.mean()),
                "kl_mean": float(kl.sum() / mask.sum()),
                "response_length_mean": float(torch.cat([e.response_length for e in stream]).float().mean()),
                "turns_mean": sum(t for e in stream for t in e.num_turns) / len(reward),
                "policy_version_sampled": max(v for e in stream for v in e.policy_version),
                "policy_version_now": response.policy_version,
                "experience_s": made - started,
                "train_s": trained - made,
                "update_s": time.monotonic() - trained,
            }
            curve.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl_mean']:.4f}",
                            length=f"{row['response_length_mean']:.0f}")
            if step % eval_every == 0 or step == steps:
                record_eval(step)
    print(json.dumps(write_results(out, curve, evals, environment), indent=2))


def write_results(out: Path, curve: list[dict], evals: list[dict], environment: str = "") -> dict:
    """Write ``summary.json`` and ``reward_curve.png`` for the steps so far (after every evaluation, so a run
    stopped early keeps its results); returns the summary."""
    summary = {
        "steps": len(curve), "held_out_accuracy_by_step": {e["step"]: e["held_out_accuracy"] for e in evals},
        "held_out_accuracy_before": evals[0]["held_out_accuracy"],
        "held_out_accuracy_after": evals[-1]["held_out_accuracy"],
    }
    if curve:
        first, last = curve[:5], curve[-5:]
        summary["train_reward_first_5_steps"] = sum(r["reward_mean"] for r in first) / len(first)
        summary["train_reward_last_5_steps"] = sum(r["reward_mean"] for r in last) / len(last)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(curve, evals, out / "reward_curve.png", environment)
    return summary


def plot(curve: list[dict], evals: list[dict], path: Path, environment: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r["step"] for r in curve], [r["reward_mean"] for r in curve], marker=".", label="train reward (T=1)")
    axis.plot([e["step"] for e in evals], [e["held_out_accuracy"] for e in evals], marker="o",
              label="held-out accuracy (greedy)")
    axis.set_xlabel("step (policy version)")
    axis.set_ylabel("math-verify reward")
    title = f"GRPO through fastexp: SmolLM2-135M on {TASK}"
    axis.set_title(title + (f"\nmulti-turn episodes in {environment}" if environment else ""), fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":  # vLLM's engine spawns processes: keep the entry point guarded
    typer.run(main)

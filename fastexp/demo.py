"""``fastexp demo``: stream real experiences from SmolLM2 on reasoning-gym problems through the three services.

Writes ``<out>/experiences.jsonl`` (one row per sample), ``<out>/batch_NNNN.safetensors`` (the tensors of each
ExperienceBatch, seed names) and ``<out>/summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file
from tqdm import tqdm

from fastexp.datasets import reasoning_gym_problems
from fastexp.launcher import LocalCluster
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common.models import resolve_model
from services.experience.sdk import ExperienceClient, Sampling
from services.experience.types import Experience

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 256
    task: str = "gsm_symbolic"
    advantage_estimator: str = "group_norm"
    backend: str = "auto"
    model: str = "smollm2-135m-instruct"
    out: Path = Path("out/demo")
    seed: int = 0


def run_demo(options: DemoOptions) -> dict:
    """Run the demo end to end and return the summary written to ``summary.json``."""
    options.out.mkdir(parents=True, exist_ok=True)
    for stale in options.out.glob("batch_*.safetensors"):
        stale.unlink()
    problems = reasoning_gym_problems(options.task, options.num_prompts, seed=options.seed)
    model = resolve_model(options.model)  # convert once here, before three processes want it
    overrides = {
        "generator": {"model": model, "backend": options.backend},
        "experience": {"actor_model": model, "reference_model": model},
    }
    with LocalCluster(overrides=overrides, log_dir=options.out / "logs") as cluster:
        info = _model_info(cluster.address("generator"))
        with ExperienceClient(cluster.address("experience")) as client:
            summary = _stream(client, problems, options)
    summary.update(model=options.model, backend=info.backend, task=options.task, cores=os.cpu_count(),
                   torch_threads=torch.get_num_threads())
    (options.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_summary(summary)
    return summary


def _stream(client: ExperienceClient, problems, options: DemoOptions) -> dict:
    rows: list[dict] = []
    kl_sum = kl_tokens = mismatch_sum = 0.0
    started = time.monotonic()
    first_at = None
    stream = client.make_experiences(
        [list(p.messages) for p in problems],
        references=[p.reference for p in problems],
        labels=[p.label for p in problems],
        n_samples_per_prompt=options.n_samples_per_prompt,
        sampling=Sampling(temperature=1.0, max_new_tokens=options.max_new_tokens),
        advantage_estimator=options.advantage_estimator,
        packing_samples=True,  # packed forwards, each group's prompt computed once
    )
    with (options.out / "experiences.jsonl").open("w") as jsonl, tqdm(
        total=len(problems), unit="prompt", desc="experiences"
    ) as bar:
        for experience in stream:
            first_at = first_at or time.monotonic()
            _save_batch(experience, options.out)
            kl_sum += float(experience.kl.sum())
            kl_tokens += float(experience.action_mask.sum())
            mismatch_sum += float((experience.rollout_log_probs - experience.action_log_probs).abs().sum())
            for row in _rows(experience):
                jsonl.write(json.dumps(row) + "\n")
                rows.append(row)
            bar.update(len(set(experience.prompt_index)))
            bar.set_postfix(reward=f"{sum(r['reward'] for r in rows) / len(rows):.3f}")
    elapsed = time.monotonic() - started
    tokens = sum(r["response_length"] for r in rows)
    return {
        "num_prompts": len(problems),
        "n_samples_per_prompt": options.n_samples_per_prompt,
        "num_experiences": len(rows),
        "reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "kl_mean": kl_sum / max(kl_tokens, 1.0),
        # mean |generator log-prob - actor log-prob| per response token: engine numerics (vLLM vs HF, bf16)
        "rollout_vs_actor_log_prob_abs_diff": mismatch_sum / max(kl_tokens, 1.0),
        "response_length_mean": tokens / len(rows),
        "response_length_max": max(r["response_length"] for r in rows),
        "response_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "time_to_first_experience_s": (first_at or time.monotonic()) - started,
        "wall_time_s": elapsed,
    }


def _model_info(address: str) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=30
        )


def _rows(experience: Experience) -> list[dict]:
    correct = experience.reward_metrics.get("math_verify/correct", (experience.reward > 0.5).float())
    mask = experience.action_mask
    kl_mean = (experience.kl.sum(1) / mask.sum(1).clamp(min=1)).tolist()
    return [
        {
            "batch_index": experience.batch_index,
            "prompt_index": experience.prompt_index[i],
            "sample_index": experience.sample_index[i],
            "policy_version": experience.policy_version[i],
            "prompt": experience.prompt_texts[i],
            "response": experience.response_texts[i],
            "reward": float(experience.reward[i]),
            "correct": float(correct[i]),
            "advantage": float(experience.advantages[i, 0]),
            "kl_mean": kl_mean[i],
            "response_length": int(experience.response_length[i]),
            "total_length": int(experience.total_length[i]),
        }
        for i in range(len(experience.prompt_index))
    ]


def _save_batch(experience: Experience, out: Path) -> None:
    tensors = {
        name: getattr(experience, name).contiguous()
        for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs",
                     "returns", "advantages", "kl", "reward", "response_length", "total_length", "rollout_log_probs")
    }
    tensors["prompt_index"] = torch.tensor(experience.prompt_index)
    tensors["sample_index"] = torch.tensor(experience.sample_index)
    save_file(tensors, out / f"batch_{experience.batch_index:04d}.safetensors")


def _print_summary(summary: dict) -> None:
    table = Table(title="fastexp demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)

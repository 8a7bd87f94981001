"""``fastexp demo``: stream real experiences from SmolLM2 on reasoning-gym problems through the three services.

Writes ``<out>/experiences.jsonl`` (one row per sample), ``<out>/batch_NNNN.safetensors`` (the tensors of each
ExperienceBatch, seed names), ``<out>/summary.json`` and ``<out>/demo.png`` (rewards per group, the advantage
distribution, and when each ExperienceBatch arrived against the generator's progress), and prints a short table.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file
from tqdm import tqdm

from fastexp import ExperienceClient, Sampling
from fastexp.types import Experience
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common.models import resolve_model
from services.demo.datasets import task_problems
from services.launcher import LocalCluster, free_port, fresh_state_dir

logger = logging.getLogger(__name__)

#: The figures the demo prints at the end (summary.json has more).
HEADLINE = {
    "reward_mean": "reward mean",
    "accuracy": "accuracy (math-verify)",
    "groups_with_nonzero_advantage": "prompt groups with non-zero advantages",
    "rows_with_nonzero_advantage": "rows with non-zero advantages",
    "kl_mean": "KL to the reference (nats/token)",
    "tokens_per_s": "response tokens/s, end to end",
    "time_to_first_experience_s": "time to first ExperienceBatch (s)",
    "wall_time_s": "stream wall time (s)",
    "startup_s": "services start-up, to all SERVING (s)",
}


@dataclass(frozen=True)
class DemoOptions:
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 256
    task: str = "basic_arithmetic"
    advantage_estimator: str = "group_norm"
    backend: str = "auto"
    model: str = "smollm2-135m-instruct"
    out: Path = Path("out/demo")
    seed: int = 0


@dataclass(frozen=True)
class Arrival:
    """An ExperienceBatch as the trainer received it: seconds since the stream started, and its rows."""

    at_s: float
    rows: int


def run_demo(options: DemoOptions) -> dict:
    """Run the demo end to end and return the summary written to ``summary.json``.

    Raises:
        services.launcher.ServicesNotReady: the services did not all report SERVING in time (each named, with the
            tail of its log under ``<out>/logs``).
    """
    from services.demo.plot import plot_demo

    options.out.mkdir(parents=True, exist_ok=True)
    for stale in options.out.glob("batch_*.safetensors"):
        stale.unlink()
    problems = task_problems(options.task, options.num_prompts, seed=options.seed)
    began = time.monotonic()
    model = resolve_model(options.model)  # convert once here, before three processes want it
    model_prepare_s = time.monotonic() - began
    metrics_port = free_port()
    overrides = {
        "generator": {"model": model, "backend": options.backend, "metrics_port": metrics_port},
        "experience": {"actor_model": model, "reference_model": model},
    }
    began = time.monotonic()
    with LocalCluster(overrides=overrides, log_dir=options.out / "logs",
                      state_dir=fresh_state_dir(options.out / "state")) as cluster:
        startup_s = time.monotonic() - began
        info = _model_info(cluster.address("generator"))
        with ExperienceClient(cluster.address("experience")) as client, \
                GenerationProgress(f"http://127.0.0.1:{metrics_port}/metrics") as progress:
            summary, rows, arrivals = _stream(client, problems, options)
    summary.update(model=options.model, backend=info.backend, task=options.task, cores=os.cpu_count(),
                   torch_threads=torch.get_num_threads(), model_prepare_s=model_prepare_s, startup_s=startup_s)
    (options.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_demo(rows, arrivals, progress.samples, summary, options.out / "demo.png")
    _print_summary(summary, options.out)
    return summary


class GenerationProgress:
    """Samples the generator's ``fastexp_generated_tokens_total`` (response tokens of finished samples) every
    ``interval_s`` from its Prometheus endpoint while the stream runs: ``samples`` is ``[(seconds, tokens)]``
    with seconds since the context was entered."""

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self._url = url
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation-progress", daemon=True)
        self.samples: list[tuple[float, float]] = []

    def __enter__(self) -> GenerationProgress:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per scrape
        self._started = time.monotonic()
        self._baseline = self._read() or 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            tokens = self._read()
            if tokens is not None:
                self.samples.append((time.monotonic() - self._started, tokens - self._baseline))

    def _read(self) -> float | None:
        try:
            text = httpx.get(self._url, timeout=2.0).text
        except httpx.HTTPError:
            return None
        return sum(
            sample.value
            for family in text_string_to_metric_families(text) if family.name == "fastexp_generated_tokens"
            for sample in family.samples if sample.name == "fastexp_generated_tokens_total"
        )


def _stream(client: ExperienceClient, problems, options: DemoOptions) -> tuple[dict, list[dict], list[Arrival]]:
    rows: list[dict] = []
    arrivals: list[Arrival] = []
    kl_sum = kl_tokens = mismatch_sum = 0.0
    started = time.monotonic()
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
            arrivals.append(Arrival(time.monotonic() - started, len(experience.prompt_index)))
            _save_batch(experience, options.out)
            kl_sum += 0.0 if experience.kl is None else float(experience.kl.sum())
            kl_tokens += float(experience.action_mask.sum())
            mismatch_sum += float((experience.rollout_log_probs - experience.action_log_probs).abs().sum())
            for row in _rows(experience):
                jsonl.write(json.dumps(row) + "\n")
                rows.append(row)
            bar.update(len(set(experience.prompt_index)))
            bar.set_postfix(reward=f"{sum(r['reward'] for r in rows) / len(rows):.3f}")
    elapsed = time.monotonic() - started
    tokens = sum(r["response_length"] for r in rows)
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["prompt_index"], []).append(row)
    summary = {
        "num_prompts": len(problems),
        "n_samples_per_prompt": options.n_samples_per_prompt,
        "num_experiences": len(rows),
        "reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        # the learning signal: a group whose samples all got the same reward has zero group-baseline advantages
        "groups_with_nonzero_advantage": sum(any(r["advantage"] != 0 for r in g) for g in groups.values())
        / len(groups),
        "rows_with_nonzero_advantage": sum(r["advantage"] != 0 for r in rows) / len(rows),
        "kl_mean": kl_sum / max(kl_tokens, 1.0),
        # mean |generator log-prob - actor log-prob| per response token: engine numerics (vLLM vs HF, bf16)
        "rollout_vs_actor_log_prob_abs_diff": mismatch_sum / max(kl_tokens, 1.0),
        "response_length_mean": tokens / len(rows),
        "response_length_max": max(r["response_length"] for r in rows),
        "response_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "time_to_first_experience_s": arrivals[0].at_s if arrivals else elapsed,
        "wall_time_s": elapsed,
        "num_batches": len(arrivals),
    }
    return summary, rows, arrivals


def _model_info(address: str) -> generation_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=30
        )


def _rows(experience: Experience) -> list[dict]:
    correct = experience.reward_metrics.get("math_verify/correct", (experience.reward > 0.5).float())
    mask = experience.action_mask
    kl = experience.kl if experience.kl is not None else torch.zeros(mask.shape)
    kl_mean = (kl.sum(1) / mask.sum(1).clamp(min=1)).tolist()
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
    names = ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "returns",
             "advantages", "kl", "reward", "response_length", "total_length", "rollout_log_probs")
    tensors = {name: getattr(experience, name).contiguous() for name in names if getattr(experience, name) is not None}
    tensors["prompt_index"] = torch.tensor(experience.prompt_index)
    tensors["sample_index"] = torch.tensor(experience.sample_index)
    save_file(tensors, out / f"batch_{experience.batch_index:04d}.safetensors")


def _print_summary(summary: dict, out: Path) -> None:
    table = Table(title=f"fastexp demo: {summary['num_experiences']} experiences, {summary['task']}, "
                        f"{summary['backend']} backend")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, label in HEADLINE.items():
        value = summary[key]
        table.add_row(label, f"{value:.1%}" if key.endswith("_advantage") else f"{value:.4g}")
    Console().print(table)
    Console().print(f"written: {out}/summary.json, {out}/demo.png, {out}/experiences.jsonl, {out}/batch_*.safetensors")

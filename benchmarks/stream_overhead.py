"""The experience stream against generation alone, on the demo's workload, and what the forwards cost (ratio 7).

Workload: the demo's sizes — 16 reasoning-gym ``gsm_symbolic`` chat prompts x 4 samples at temperature 1, up to
256 new tokens (GSM-style answers run long, so the forwards are as heavy as they get here) — on the generator's
vLLM engine with the launcher's default core split (:class:`services.launcher.CoreSplit`). Every run is seeded
(vLLM seeds each sample with ``seed + sample_index``), so all runs sample the same tokens and their times compare
the same work. Runs, on one set of services, in this order:

- ``generation``: a ``Generate`` stream of the same prompt ids, read to the end (no scoring, no forwards).
- ``stream``: ``MakeExperiences`` as the demo sends it (actor and reference forwards, ``group_norm``).
- ``stream_skip_actor``: the same with ``skip_actor_forward`` (the reference still runs: ``kl_coef`` 0.01).
- ``stream_lean``: ``skip_actor_forward`` and ``kl_coef`` 0 (no reference): generation and scoring only.

Figures (each a ratio of two times taken here, in this run): ``stream_vs_generation`` (target <= 1.3),
``stream_skip_actor_vs_generation``, ``stream_lean_vs_generation``, ``reference_free_vs_with_reference`` =
``stream_lean`` / ``stream_skip_actor`` (what skipping the reference saves), and ``first_batch_vs_generation`` (the
stream's first batch against generation alone).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.pipeline import generate_once
from fastexp import ExperienceClient, RequestOptions, Sampling
from services.demo.datasets import task_problems
from services.launcher import CoreSplit, LocalCluster, fresh_state_dir


@dataclass(frozen=True)
class DemoWorkload:
    """The runs' prompts and sampling (the demo's sizes on GSM-style problems)."""

    task: str = "gsm_symbolic"
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 256
    seed: int = 0


def run(model: str, workload: DemoWorkload, log_dir: Path, core_split: CoreSplit | None = None,
        name: str = "stream_overhead") -> dict:
    """Measure the four runs on ``model`` (a local folder); returns the figures, their inputs and the workload.
    ``core_split``: the host's cores between the engine and the forwards (None: the launcher's default);
    ``name``: the runs' log folder."""
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, seed=workload.seed)
    base = RequestOptions(n_samples_per_prompt=workload.n_samples_per_prompt, sampling=sampling,
                          advantage_estimator="group_norm", packing_samples=True)
    overrides = {"generator": {"model": model, "backend": "vllm"},
                 "experience": {"actor_model": model, "reference_model": model}}
    split = {"core_split": core_split} if core_split is not None else {}
    with LocalCluster(overrides=overrides, log_dir=log_dir / name, state_dir=fresh_state_dir(log_dir / f"{name}-state"),
                      **split) as cluster:
        address = cluster.address("experience")
        prompt_ids = _prompt_ids(model, problems)
        generate_once(cluster.address("generator"), prompt_ids[:2], 1, Sampling(max_new_tokens=8))  # warm-up
        generation = generate_once(cluster.address("generator"), prompt_ids, workload.n_samples_per_prompt, sampling)
        stream = _stream(address, problems, base)
        skip_actor = _stream(address, problems, dataclasses.replace(base, skip_actor_forward=True))
        lean = _stream(address, problems, dataclasses.replace(base, skip_actor_forward=True, kl_coef=0.0))
    return {
        "stream_vs_generation": stream["seconds"] / generation["seconds"],
        "stream_skip_actor_vs_generation": skip_actor["seconds"] / generation["seconds"],
        "stream_lean_vs_generation": lean["seconds"] / generation["seconds"],
        "reference_free_vs_with_reference": lean["seconds"] / skip_actor["seconds"],
        "first_batch_vs_generation": stream["first_batch_s"] / generation["seconds"],
        "stream_overhead_inputs": {"generation": generation, "stream": stream, "stream_skip_actor": skip_actor,
                                   "stream_lean": lean},
        "stream_overhead_workload": {**asdict(workload), "model": model, "backend": "vllm"},
    }


def _prompt_ids(model: str, problems) -> list[list[int]]:
    """The prompts rendered and tokenized as the experience service does (``render_prompt``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [
        tokenizer(tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        for p in problems
    ]


def _stream(address: str, problems, options: RequestOptions) -> dict:
    """One ``MakeExperiences`` stream read to the end: wall seconds from the call to the last batch, tokens."""
    with ExperienceClient(address) as client:
        client.wait_until_ready(600)
        started = time.perf_counter()
        first, tokens, samples = None, 0, 0
        for experience in client.make_experiences(
            [list(p.messages) for p in problems], options, references=[p.reference for p in problems],
        ):
            first = first if first is not None else time.perf_counter() - started
            tokens += int(experience.response_length.sum())
            samples += len(experience.response_length)
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "first_batch_s": first, "tokens": tokens, "samples": samples,
            "tokens_per_s": tokens / seconds}

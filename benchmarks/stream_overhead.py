"""The experience stream against generation alone, on the demo's workload, and what the forwards cost (ratio 7).

Workload: the demo's sizes — 16 reasoning-gym ``gsm_symbolic`` chat prompts x 4 samples at temperature 1, up to
256 new tokens (GSM-style answers run long, so the forwards are as heavy as they get here) — on the generator's
vLLM engine (:data:`GENERATOR`: no LoRA slots, compiled, as TRL's engine is) with the launcher's default core split
(:class:`services.launcher.CoreSplit`). Every run is seeded (vLLM seeds each sample with ``seed + sample_index``),
yet runs need not sample the same tokens (bf16 sums depend on how the engine batched the rows), so every figure but
the first batch's compares seconds per token. Runs, on one set of services, in this order:

- ``generation``: a ``Generate`` stream of the same prompt ids, read to the end (no scoring, no forwards).
- ``stream``: ``MakeExperiences`` as the demo sends it (actor and reference forwards, ``group_norm``), after a
  warm-up stream of the first prompt alone (as TRL's timed call in :mod:`benchmarks.trl_experience` comes after a
  warm-up call of one prompt, and the compute floor's forwards are the better of two passes): the service's first
  forwards otherwise pay for what they touch first (the allocator's pools, the kernels' first shapes), 5 % of the
  stream on this project's machines in one run (2026-11-27).
- ``stream_skip_actor``: the same with ``skip_actor_forward`` (the reference still runs: ``kl_coef`` 0.01).
- ``stream_lean``: ``skip_actor_forward`` and ``kl_coef`` 0 (no reference): generation and scoring only.

Then, with the services stopped, the **compute floor**: the forwards the streams ran, alone in this process on every
core (the service's dtype, packed shared-prompt chunks of ``forward_micro_batch_size`` rows, the same model for actor
and reference) over the samples the ``generation`` run drew. The floor of a stream is the time its work takes when
each part has the whole machine and nothing overlaps: generation alone + the actor's and the reference's forwards
(``stream``), + the reference's (``stream_skip_actor``), per token of the generation run.

Figures (each a ratio of two times taken here, in this run): ``stream_vs_generation`` (target <= 1.3),
``stream_skip_actor_vs_generation``, ``stream_lean_vs_generation``, ``reference_free_vs_with_reference`` =
``stream_lean`` / ``stream_skip_actor`` (what skipping the reference saves), ``first_batch_vs_generation`` (the
stream's first batch against generation alone), and ``stream_vs_compute_floor`` /
``stream_skip_actor_vs_compute_floor``: the floor's seconds per token over the stream's (target >= 0.9; above 1
where sharing the cores beats running the parts one after another).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.pipeline import generate_completions
from fastexp import ExperienceClient, RequestOptions, Sampling
from services.common.dtypes import resolve_dtype
from services.common.generation import CompletionRecord
from services.demo.datasets import task_problems
from services.experience.config import PromptSpec
from services.experience.settings import ExperienceSettings
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.sequences import build_rollout
from services.launcher import CoreSplit, LocalCluster, fresh_state_dir

#: The generator as a full-weight deployment sets it up: vLLM, no adapter slots, compiled graphs (vLLM's CPU build
#: compiles only with LoRA off, and needs a C++ compiler). TRL's colocated engine, which
#: :mod:`benchmarks.trl_experience` compares with, is built the same way (no LoRA, compiled). Decoding 16 x 4 GSM
#: answers here: 520-540 tokens/s with the defaults (``max_loras`` 4, eager), 540-550 with LoRA off, 610-640
#: compiled (benchmarks/README.md).
GENERATOR = {"backend": "vllm", "max_loras": 0, "enforce_eager": False}


def generator_settings(compiled: bool) -> dict:
    """:data:`GENERATOR`, eager where ``compiled`` is false or no C++ compiler is found (``CXX``, else ``g++``: what
    torch's inductor calls)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    return {**GENERATOR, "enforce_eager": not (compiled and compiler)}


@dataclass(frozen=True)
class DemoWorkload:
    """The runs' prompts and sampling (the demo's sizes on GSM-style problems)."""

    task: str = "gsm_symbolic"
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 256
    seed: int = 0


def run(model: str, workload: DemoWorkload, log_dir: Path, core_split: CoreSplit | None = None,
        name: str = "stream_overhead", compiled: bool = True) -> dict:
    """Measure the four runs on ``model`` (a local folder); returns the figures, their inputs and the workload.
    ``core_split``: the host's cores between the engine and the forwards (None: the launcher's default);
    ``name``: the runs' log folder; ``compiled``: the engine's graphs compiled where a C++ compiler is found
    (:func:`generator_settings`; the smoke run skips the compile's minute)."""
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, seed=workload.seed)
    base = RequestOptions(n_samples_per_prompt=workload.n_samples_per_prompt, sampling=sampling,
                          advantage_estimator="group_norm", packing_samples=True)
    generator = generator_settings(compiled)
    overrides = {"generator": {"model": model, **generator},
                 "experience": {"actor_model": model, "reference_model": model}}
    split = {"core_split": core_split} if core_split is not None else {}
    with LocalCluster(overrides=overrides, log_dir=log_dir / name, state_dir=fresh_state_dir(log_dir / f"{name}-state"),
                      **split) as cluster:
        address = cluster.address("experience")
        prompt_ids = _prompt_ids(model, problems)
        _generate(cluster.address("generator"), prompt_ids[:2], 1, Sampling(max_new_tokens=8))  # warm-up
        generation, records = _generate(cluster.address("generator"), prompt_ids, workload.n_samples_per_prompt,
                                        sampling)
        _stream(address, problems[:1], base)  # warm-up, as TRL's timed call has (benchmarks/trl_experience.py)
        stream = _stream(address, problems, base)
        skip_actor = _stream(address, problems, dataclasses.replace(base, skip_actor_forward=True))
        lean = _stream(address, problems, dataclasses.replace(base, skip_actor_forward=True, kl_coef=0.0))
    forwards = forwards_alone(model, records, prompt_ids)
    floor = generation["seconds"] + 2 * forwards["seconds_per_model"]  # over the generation run's samples
    floor_skip_actor = generation["seconds"] + forwards["seconds_per_model"]

    def per_token(seconds: float, run: dict) -> float:
        return seconds / run["tokens"]

    generation_s = per_token(generation["seconds"], generation)
    return {
        "stream_vs_generation": per_token(stream["seconds"], stream) / generation_s,
        "stream_skip_actor_vs_generation": per_token(skip_actor["seconds"], skip_actor) / generation_s,
        "stream_lean_vs_generation": per_token(lean["seconds"], lean) / generation_s,
        "reference_free_vs_with_reference": per_token(lean["seconds"], lean)
        / per_token(skip_actor["seconds"], skip_actor),
        "first_batch_vs_generation": stream["first_batch_s"] / generation["seconds"],
        "stream_vs_compute_floor": per_token(floor, generation) / per_token(stream["seconds"], stream),
        "stream_skip_actor_vs_compute_floor": per_token(floor_skip_actor, generation)
        / per_token(skip_actor["seconds"], skip_actor),
        "stream_overhead_inputs": {"generation": generation, "stream": stream, "stream_skip_actor": skip_actor,
                                   "stream_lean": lean, "forwards_alone": forwards,
                                   "compute_floor_s": {"stream": floor, "stream_skip_actor": floor_skip_actor}},
        "stream_overhead_workload": {**asdict(workload), "model": model, "generator": generator},
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


def _generate(address: str, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> tuple[dict, list]:
    """One ``Generate`` stream read to the end: its tokens and wall seconds, and the samples it drew."""
    seconds, completions = generate_completions(address, prompt_ids, n, sampling)
    records = [CompletionRecord(prompt_index=c.prompt_index, sample_index=c.sample_index,
                                prompt_token_ids=tuple(c.prompt_token_ids), output_token_ids=tuple(c.output_token_ids),
                                output_log_probs=np.zeros(len(c.output_token_ids), np.float32), finish_reason="stop",
                                text="", policy_version=0) for c in completions]
    tokens = sum(len(r.output_token_ids) for r in records)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}, records


def forwards_alone(model: str, records: list[CompletionRecord], prompt_ids: list[list[int]]) -> dict:
    """One model's forward over ``records`` as the experience service runs it (its default dtype and micro-batch,
    packed shared-prompt chunks, rows in prompt order), on every core of this process: wall seconds of the best of two
    passes (the first also warms the allocator), the figure a stream's actor and reference forwards each cost."""
    settings = ExperienceSettings()
    dtype = resolve_dtype(settings.dtype, "cpu")
    logprobs = LogProbModel.load(model, dtype=dtype, device="cpu")
    prompts = [PromptSpec(text="", token_ids=tuple(ids), reference="", label="") for ids in prompt_ids]
    ordered = sorted(records, key=lambda r: (r.prompt_index, r.sample_index))
    rollout = build_rollout(ordered, prompts, pad_token_id=0)
    parts = chunks(rollout, settings.forward_micro_batch_size, packed=True, share_prompt=True)
    passes = []
    for _ in range(2):
        started = time.perf_counter()
        logprobs.action_log_probs(parts)
        passes.append(time.perf_counter() - started)
    return {"seconds_per_model": min(passes), "passes_s": passes, "dtype": dtype, "threads": torch.get_num_threads(),
            "micro_batch_size": settings.forward_micro_batch_size, "rows": len(ordered)}


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

"""LLM judges: batched judge calls against one call per response (issue 34, target >= 3), and the reward cache on
a workload with dynamic-sampling refills (hit rate and judge calls saved).

Set-up: the embedded SmolLM2-135M-Instruct behind a fastexp generator (HF backend, float32, up to 64 sequences
per chunk), started in process; the scorer's :class:`~services.scorer.judges.source.JudgeScorer` speaks to it over
gRPC ``Generate``, the chat template applied, greedy; the judge explains in a sentence and then rates (up to 48
tokens; the verdict is the last number it writes, regex ``(?s)(\\d+)(?!.*\\d)``, score range 0-10).

- ``batched``: 64 responses to 16 ``basic_arithmetic`` problems judged with ``batch_size`` 64 (one ``Generate``).
- ``per_response``: the same 64 judged with ``batch_size`` 1 and ``budget.max_concurrency`` 1 (64 ``Generate``
  calls, one after the other: what a reward function calling its judge per sample does).

Figure ``judge_batched_vs_per_response`` = seconds of ``per_response`` / seconds of ``batched`` (same prompts, same
greedy answers, cache off in both).

Cache: the policy (the same SmolLM2 generator, temperature 1, up to 6 tokens) samples 4 answers to each of 16
problems; a round judges every group; dynamic sampling keeps groups whose judged rewards differ and resamples the
others (a refill), for ``refill_rounds`` rounds; then the kept groups are judged again (a repeated evaluation).
The judge has its local cache. Figures: ``judge_cache_hit_rate`` = items answered without a judge prompt (a cache
hit, or an identical item earlier in the same request) / items judged, and ``judge_cache_calls_saved`` = the judge
prompts that were not sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import grpc
import numpy as np
from prometheus_client import REGISTRY

from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common.deadlines import Deadline
from services.demo.datasets import task_problems
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.composition import build_source
from services.scorer.judges.config import JudgeConfig
from services.scorer.scorer import ScoreItem

TEMPLATE = ("Question: {prompt}\nReference answer: {reference}\nAnswer: {response}\nIs the answer correct? Explain "
            "in one sentence, then rate it from 0 to 10 as \\boxed{score}.")


@dataclass(frozen=True)
class JudgeWorkload:
    """The judged responses and the refill workload's size."""

    task: str = "basic_arithmetic"
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    judge_max_new_tokens: int = 48
    policy_max_new_tokens: int = 6
    refill_rounds: int = 3
    seed: int = 0


def run(model: str, workload: JudgeWorkload) -> dict:
    """Measure batching and the cache on ``model`` (a local folder); returns the figures and their inputs."""
    return asyncio.run(_run(model, workload))


async def _run(model: str, workload: JudgeWorkload) -> dict:
    engine = HFEngine.start(model, dtype="float32", max_model_len=1024, max_batch_size=64)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=1024), engine)
    address = f"127.0.0.1:{generator.port}"
    try:
        problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
        items = [ScoreItem(p.prompt + answer, p.prompt, answer, "", p.reference)
                 for p in _prompts(problems) for answer in _answers(p.reference, workload.n_samples_per_prompt)]
        await _judge(address, workload, items[:2], batch_size=2, name="judge_warmup")  # tokenizer, first call
        batched = await _judge(address, workload, items, batch_size=len(items), name="judge_batched")
        single = await _judge(address, workload, items, batch_size=1, name="judge_per_response")
        cache = await _refills(address, workload, problems)
    finally:
        await generator.stop(1)
        await engine.close()
    return {
        "judge_batched_vs_per_response": single["seconds"] / batched["seconds"],
        "judge_cache_hit_rate": cache["hit_rate"],
        "judge_cache_calls_saved": cache["saved"],
        "judge_inputs": {"batched": batched, "per_response": single, "cache": cache},
        "judge_workload": {**asdict(workload), "model": model, "backend": "hf"},
    }


@dataclass(frozen=True)
class _Prompt:
    prompt: str
    reference: str


def _prompts(problems) -> list[_Prompt]:
    return [_Prompt(p.messages[-1]["content"] + " ", p.reference) for p in problems]


def _answers(reference: str, n: int) -> list[str]:
    """n responses per problem: right, wrong by one, verbose, wrong (fixed, so both runs judge the same texts)."""
    variants = [reference, f"{reference}1", f"The answer is {reference}.", "I do not know."]
    return [variants[i % len(variants)] for i in range(n)]


def _config(address: str, workload: JudgeWorkload, *, batch_size: int, name: str, cache: bool) -> JudgeConfig:
    return JudgeConfig(
        name=name, backend="generator", address=address, template=TEMPLATE, max_new_tokens=workload.judge_max_new_tokens,
        verdict={"kind": "regex", "pattern": r"(?s)(\d+)(?!.*\d)"}, score_range=(0, 10), batch_size=batch_size,
        budget={"max_concurrency": 1 if batch_size == 1 else 4}, cache={"enabled": cache}, timeout_s=1800,
    )


async def _judge(address: str, workload: JudgeWorkload, items: list[ScoreItem], *, batch_size: int,
                 name: str) -> dict:
    source = build_source(_config(address, workload, batch_size=batch_size, name=name, cache=False))
    await source.start()
    try:
        started = time.perf_counter()
        scores = await source.score(items, Deadline.from_remaining(3600))
        seconds = time.perf_counter() - started
    finally:
        await source.close()
    return {"seconds": seconds, "items": len(items), "calls": _calls(name), "scored": int((~scores.failed).sum()),
            "completion_tokens": float(scores.metrics["completion_tokens"].sum())}


def _calls(source: str) -> int:
    return int(REGISTRY.get_sample_value("fastexp_reward_source_calls_total", {"source": source, "outcome": "ok"})
               or 0)


def _lookups(source: str, result: str) -> int:
    labels = {"source": source, "result": result}
    return int(REGISTRY.get_sample_value("fastexp_reward_source_cache_lookups_total", labels) or 0)


async def _refills(address: str, workload: JudgeWorkload, problems) -> dict:
    """Dynamic sampling with refills, then a repeated evaluation, judged through the cache (module docs)."""
    name = "judge_cached"
    source = build_source(_config(address, workload, batch_size=64, name=name, cache=True))
    await source.start()
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    prompts = _prompts(problems)
    kept: list[list[ScoreItem]] = []
    pending = list(range(len(prompts)))
    judged = 0
    try:
        for round_ in range(workload.refill_rounds):
            groups = await _sample(stub, [prompts[i] for i in pending], workload, seed=workload.seed + round_)
            scores = await source.score([item for group in groups for item in group], Deadline.from_remaining(3600))
            judged += sum(len(group) for group in groups)
            rewards = scores.rewards.reshape(len(groups), -1)
            varied = [g for g, row in enumerate(np.nan_to_num(rewards, nan=-1.0)) if len(set(row.tolist())) > 1]
            kept += [groups[g] for g in varied]
            pending = [pending[g] for g in range(len(groups)) if g not in varied]
            if not pending:
                break
        evaluation = [item for group in kept for item in group]
        await source.score(evaluation, Deadline.from_remaining(3600))  # the repeated evaluation
        judged += len(evaluation)
    finally:
        await channel.close()
        await source.close()
    hits, shared, misses = (_lookups(name, result) for result in ("hit", "shared", "miss"))
    return {"items_judged": judged, "judge_prompts_sent": misses, "cache_hits": hits, "shared_in_request": shared,
            "hit_rate": (hits + shared) / max(judged, 1), "saved": judged - misses}


async def _sample(stub, prompts: list[_Prompt], workload: JudgeWorkload, *, seed: int) -> list[list[ScoreItem]]:
    """The policy's n answers to each prompt (the generator, temperature 1)."""
    request = generation_pb2.GenerateRequest(
        request_id=f"policy-{seed}", prompts=[generation_pb2.GenerationPrompt(text=p.prompt) for p in prompts],
        sampling=generation_pb2.SamplingParams(temperature=1.0, max_new_tokens=workload.policy_max_new_tokens,
                                               skip_special_tokens=True, seed=seed),
        n_samples_per_prompt=workload.n_samples_per_prompt,
    )
    groups: list[list[ScoreItem]] = [[] for _ in prompts]
    async for response in stub.Generate(request, timeout=3600):
        for c in response.completions:
            p = prompts[c.prompt_index]
            groups[c.prompt_index].append(ScoreItem(p.prompt + c.text, p.prompt, c.text, "", p.reference))
    return groups


if __name__ == "__main__":  # alone: python -m benchmarks.judge (make bench runs it with the others)
    import json

    from services.common.models import SMOLLM2_ALIAS, resolve_model

    print(json.dumps(run(resolve_model(SMOLLM2_ALIAS), JudgeWorkload()), indent=2))

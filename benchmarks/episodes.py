"""Multi-turn episodes: the experience service's asynchronous episode loop against a turn-synchronous loop (ratio 9;
issue 23, target >= 1.5).

Workload: 16 reasoning-gym ``basic_arithmetic`` chat prompts x 4 episodes in the scorer's ``math_feedback``
environment, up to 3 turns of up to 96 tokens, temperature 1, on SmolLM2 with the generator's vLLM engine running
at most 16 sequences per step (so the 64 episodes' turns run in waves: the engine is the bottleneck). Every
model turn is seeded the same way in both runs (``seed + sample_index + turn x n``) and both render observations
with the same :class:`~services.experience.pipeline.episodes.ObservationRenderer`, so both sample the same tokens: the
work is identical and only the scheduling differs.

- ``asynchronous``: ``MakeExperiences`` with ``environment="math_feedback"`` (generation and the environment
  only: ``skip_actor_forward``, ``kl_coef`` 0): each episode moves to its next turn as soon as its own step is
  back, and a group streams when its episodes are done.
- ``turn_synchronous``: what batch-by-batch implementations do, driven here over the same generator and
  environment services: turn t of every running episode is submitted together, and turn t + 1 starts only once
  the slowest turn t (and its environment step) is done.

Figure: ``episodes_async_vs_turn_synchronous`` = episodes/s of the first / episodes/s of the second, with both
runs' tokens (equal when the runs sampled the same) in ``episodes_inputs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from fastexp import ExperienceClient, RequestOptions, Sampling
from fastexp.channels import message_options
from fastexp.v1 import environment_pb2, environment_pb2_grpc, generation_pb2, generation_pb2_grpc
from fastexp.wire import sampling_to_pb
from services.demo.datasets import task_problems
from services.launcher import LocalCluster, fresh_state_dir


@dataclass(frozen=True)
class EpisodeWorkload:
    """The episodes both runs play."""

    task: str = "basic_arithmetic"
    num_prompts: int = 16
    n_samples_per_prompt: int = 4
    max_turns: int = 3
    max_new_tokens: int = 96
    max_num_seqs: int = 16  # the engine's batch: 64 episodes run in waves, as a large rollout does on a GPU
    seed: int = 0
    backend: str = "vllm"


def run(model: str, workload: EpisodeWorkload, log_dir: Path) -> dict:
    """Measure both loops on ``model`` (a local folder); returns the figure, its inputs and the workload."""
    problems = task_problems(workload.task, workload.num_prompts, seed=workload.seed)
    sampling = Sampling(temperature=1.0, max_new_tokens=workload.max_new_tokens, seed=workload.seed)
    options = RequestOptions(
        n_samples_per_prompt=workload.n_samples_per_prompt, sampling=sampling, environment="math_feedback",
        max_turns=workload.max_turns, skip_actor_forward=True, kl_coef=0.0,
        micro_rollout_batch_size=workload.n_samples_per_prompt,
    )
    overrides = {"generator": {"model": model, "backend": workload.backend, "max_num_seqs": workload.max_num_seqs},
                 "experience": {"actor_model": model, "reference_model": model}}
    with LocalCluster(overrides=overrides, log_dir=log_dir / "episodes",
                      state_dir=fresh_state_dir(log_dir / "episodes-state")) as cluster:
        with ExperienceClient(cluster.address("experience")) as client:
            client.wait_until_ready(600)
            warm = dataclasses.replace(options, n_samples_per_prompt=2, micro_rollout_batch_size=2)
            list(client.make_experiences([list(problems[0].messages)], warm, references=[problems[0].reference]))
            started = time.perf_counter()
            rows = [e for e in client.make_experiences([list(p.messages) for p in problems], options,
                                                       references=[p.reference for p in problems])]
            asynchronous = {"seconds": time.perf_counter() - started,
                            "episodes": sum(len(e.reward) for e in rows),
                            "tokens": sum(int(e.action_mask.sum()) for e in rows),
                            "turns": sum(sum(e.num_turns) for e in rows)}
        synchronous = asyncio.run(_turn_synchronous(cluster, model, problems, workload))
    rate = {name: r["episodes"] / r["seconds"] for name, r in (("async", asynchronous), ("sync", synchronous))}
    return {
        "episodes_async_vs_turn_synchronous": rate["async"] / rate["sync"],
        "episodes_inputs": {"asynchronous": asynchronous, "turn_synchronous": synchronous},
        "episodes_workload": {**asdict(workload), "model": model},
    }


async def _turn_synchronous(cluster: LocalCluster, model: str, problems, workload: EpisodeWorkload) -> dict:
    """Every running episode's turn t together, then every step, then turn t + 1 (see the module docs)."""
    from transformers import AutoTokenizer

    from services.experience.pipeline.episodes import ObservationRenderer

    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer = ObservationRenderer(tokenizer)
    options = message_options(256 * 1024 * 1024)
    async with grpc.aio.insecure_channel(cluster.address("generator"), options=options) as generator_channel, \
            grpc.aio.insecure_channel(cluster.address("scorer"), options=options) as scorer_channel:
        generator = generation_pb2_grpc.GenerationServiceStub(generator_channel)
        environment = environment_pb2_grpc.EnvironmentServiceStub(scorer_channel)
        info = await generator.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=60)
        started = time.perf_counter()
        episodes = []
        for problem in problems:
            text = tokenizer.apply_chat_template(list(problem.messages), add_generation_prompt=True, tokenize=False)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            for sample in range(workload.n_samples_per_prompt):
                reply = await environment.StartEpisode(environment_pb2.StartEpisodeRequest(
                    environment="math_feedback", prompt=text, reference=problem.reference,
                    max_turns=workload.max_turns), timeout=60)
                episodes.append({"session": reply.session_id, "ids": list(ids), "sample": sample, "done": False})
        tokens, turns = 0, 0
        for turn in range(workload.max_turns):
            running = [e for e in episodes if not e["done"]]
            if not running:
                break
            completions = await asyncio.gather(*(_turn(generator, e, turn, workload, info.max_model_len)
                                                 for e in running))  # the barrier: the slowest turn
            steps = await asyncio.gather(*(environment.Step(environment_pb2.StepRequest(
                session_id=e["session"], action=c.text), timeout=60) for e, c in zip(running, completions, strict=True)))
            for episode, completion, step in zip(running, completions, steps, strict=True):
                tokens += len(completion.output_token_ids)
                turns += 1
                episode["ids"] += list(completion.output_token_ids)
                if step.done or completion.finish_reason != generation_pb2.FINISH_REASON_STOP:
                    episode["done"] = True
                    continue
                episode["ids"] += [*renderer.after_turn,
                                   *renderer.observation_ids(step.observation, step.observation_role or "user")]
        seconds = time.perf_counter() - started
        for episode in episodes:
            await environment.EndEpisode(environment_pb2.EndEpisodeRequest(session_id=episode["session"]), timeout=10)
    return {"seconds": seconds, "episodes": len(episodes), "tokens": tokens, "turns": turns}


async def _turn(generator, episode: dict, turn: int, workload: EpisodeWorkload, max_model_len: int):
    """One model turn of one episode, seeded as the experience service seeds it."""
    seed = workload.seed + episode["sample"] + turn * workload.n_samples_per_prompt
    budget = min(workload.max_new_tokens, max_model_len - len(episode["ids"]))
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(token_ids=generation_pb2.TokenIds(ids=episode["ids"]))],
        sampling=sampling_to_pb(Sampling(temperature=1.0, max_new_tokens=budget, seed=seed)), n_samples_per_prompt=1,
    )
    async for response in generator.Generate(request, timeout=600):
        return response.completions[0]
    raise RuntimeError("no completion")

"""Local, remote and rule rewards and their composition through ``MakeExperiences`` (all services in process).

The scorer runs four sources: math-verify (rule), a sequence-classifier reward model built here (model),
all-MiniLM-L6-v2 reference similarity (model), and the reference HTTP reward server serving a length rule
(model, remote). Recipes choose per label. A second experience service talks to a scorer whose remote endpoint
is down: its stream must end with UNAVAILABLE naming the endpoint, after delivering nothing it could not score.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from fastexp import Sampling, build_request
from fastexp.v1 import experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.composition import build_composer
from services.scorer.http_server import create_app
from services.scorer.server import start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.http_servers import serving

PLUGINS = "tests.support.reward_plugins"
RECIPE = {"math": 1.0, "rm": 0.5, "similarity": 0.25, "remote": 0.1}


@pytest.fixture(scope="module")
def reward_server():
    settings = ScorerSettings(sources=[
        {"type": "rule", "name": "length", "function": f"{PLUGINS}:length_reward", "workers": 1}])
    with serving(create_app(build_composer(settings))) as url:
        yield f"{url}/get_reward"


async def _experience_over(scorer_settings, generator_port, model_path):
    composer = build_composer(scorer_settings)
    scorer = await start_scorer(scorer_settings, composer)
    experience = await start_experience(
        ExperienceSettings(
            port=0, generator_address=f"127.0.0.1:{generator_port}", scorer_address=f"127.0.0.1:{scorer.port}",
            actor_model=model_path, reference_model=model_path, dtype="float32", forward_micro_batch_size=4,
            score_timeout_s=30,
        )
    )
    await experience.wait_ready(60)
    return composer, scorer, experience


@pytest.fixture(scope="module")
async def stacks(tiny_model_path, reward_model_path, reward_server):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    sources = [
        {"type": "rule", "name": "math", "function": "services.scorer.rules:math_verify_reward", "workers": 1},
        {"type": "model", "name": "rm", "path": reward_model_path, "micro_batch_size": 3},
        {"type": "similarity", "name": "similarity"},
        {"type": "remote", "name": "remote", "url": reward_server, "timeout_s": 10},
    ]
    good = ScorerSettings(port=0, sources=sources, recipes={
        "default": [("rule", "math", RECIPE["math"]), ("model", "rm", RECIPE["rm"]),
                    ("model", "similarity", RECIPE["similarity"]), ("model", "remote", RECIPE["remote"])],
        "rule_only": [("rule", "math", 1.0)],
    })
    broken = ScorerSettings(port=0, sources=[
        {"type": "rule", "name": "math", "function": "services.scorer.rules:math_verify_reward", "workers": 1},
        {"type": "remote", "name": "down", "url": "http://127.0.0.1:9/get_reward", "max_attempts": 2,
         "backoff_initial_s": 0.05},
    ], recipes={"default": [("rule", "math", 1.0), ("model", "down", 1.0)]})
    built = [await _experience_over(s, generator.port, tiny_model_path) for s in (good, broken)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{e.running.port}") for _, _, e in built]
    yield [experience_pb2_grpc.ExperienceServiceStub(c) for c in channels]
    for channel in channels:
        await channel.close()
    for composer, scorer, experience in built:
        await experience.running.stop(1)
        await experience.close()
        await scorer.stop(1)
        await composer.close()
    await generator.stop(1)
    await engine.close()


def _request(labels):
    prompts = ["What is 3 + 4?", "Say the number seven.", "What is 10 - 3?"][: len(labels)]
    return build_request(prompts, references=["7"] * len(labels), labels=labels, n_samples_per_prompt=2,
                         advantage_estimator="rloo", sampling=Sampling(max_new_tokens=8, seed=1))


async def test_local_remote_and_rule_rewards_compose_per_recipe(stacks):
    good, _ = stacks
    batches = [experience_from_pb(m) async for m in good.MakeExperiences(_request(["", "rule_only", ""]), timeout=300)]
    rows = 0
    for e in batches:
        metrics = e.reward_metrics
        for i, prompt_index in enumerate(e.prompt_index):
            rows += 1
            parts = {name: metrics[f"{name}/reward"][i].item() for name in RECIPE}
            if prompt_index == 1:  # "rule_only": only math-verify ran
                assert e.reward[i].item() == pytest.approx(parts["math"])
                assert all(math.isnan(parts[name]) for name in ("rm", "similarity", "remote"))
            else:
                assert all(math.isfinite(v) for v in parts.values())
                assert e.reward[i].item() == pytest.approx(sum(RECIPE[k] * v for k, v in parts.items()), abs=1e-5)
                # the remote server's own metrics arrive under the remote source's prefix
                chars = metrics["remote/length/chars"][i].item()
                assert chars == len(e.response_texts[i])
                assert parts["remote"] == pytest.approx(chars / 10)
                assert -1.0 <= parts["similarity"] <= 1.0
            assert metrics["math/failed"][i].item() == 0.0
    assert rows == 6
    assert {"math/correct", "math/answer_found", "rm/failed", "similarity/failed", "remote/failed"} <= set(metrics)
    assert all(torch.isfinite(e.advantages).all() for e in batches)


async def test_a_broken_reward_endpoint_ends_the_stream_unavailable_naming_it(stacks):
    _, broken = stacks
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in broken.MakeExperiences(_request(["", ""]), timeout=300):
            pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    details = caught.value.details()
    assert "prompt " in details and "have no reward" in details and "down (http://127.0.0.1:9/get_reward)" in details

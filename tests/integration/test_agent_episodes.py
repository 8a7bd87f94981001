"""Agent episodes through ``MakeExperiences`` on the real services: an agent server written with the official
``openai`` client runs each sample against the experience service's gateway, and the stream carries its episodes as
token-exact rows (the ids the agent was sampled, ``action_mask`` on them only, the actor's log-probs an independent
forward's); a framework that rewrites history gives split rows whose group statistics are taken over episodes; a
crashed or slow agent costs its group only; a cancelled stream ends the agent's sessions. SmolLM2 (HF backend)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import fastapi
import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from fastexp.request import build_request
from fastexp.sampling import SamplingOptions
from fastexp.status import FAILED_KEY
from fastexp.v1 import experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.experience.gateway.serving import start_gateway
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings

pytestmark = [pytest.mark.smollm2]

TOKEN = "agent-episodes-token"
METADATA = (("authorization", f"Bearer {TOKEN}"),)
QUESTIONS = ["What is 2 + 3? Answer with the number only.", "What is 4 + 4? Answer with the number only."]


class AgentLog:
    """What the agent server saw: each episode's sampled ids per call, and how hanging episodes ended."""

    def __init__(self) -> None:
        self.sampled: dict[str, list[list[int]]] = defaultdict(list)  # episode_id -> each call's sampled ids
        self.hanging = 0
        self.after_cancel: list[str] = []  # what a call with a hanging episode's session met once disconnected
        self.changed = asyncio.Condition()

    async def note(self, **changes: int) -> None:
        async with self.changed:
            for name, value in changes.items():
                setattr(self, name, getattr(self, name) + value)
            self.changed.notify_all()

    async def wait_for(self, predicate) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: predicate(self)), 300)


def _agent_app(log: AgentLog) -> fastapi.FastAPI:
    """Agents as users write them, on the official client: ``/calc`` two calls continuing the conversation,
    ``/drift`` the same with its first reply rewritten (as frameworks that re-render history do), ``/flaky`` fails
    on prompts saying "crash" and never answers those saying "slow", ``/hang`` makes one call and waits for the
    service to hang up."""
    app = fastapi.FastAPI()

    async def call(body: dict, messages: list[dict]) -> openai.types.chat.ChatCompletion:
        session = body["session"]
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        reply = await client.chat.completions.create(model=session["model"], messages=messages, max_tokens=16,
                                                     temperature=0, extra_body={"return_token_ids": True})
        log.sampled[body["episode_id"]].append(reply.choices[0].model_extra["token_ids"])
        return reply

    async def two_calls(body: dict, rewrite: bool) -> dict:
        messages = list(body["messages"])
        first = await call(body, messages)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        if rewrite:
            reply = {"role": "assistant", "content": (reply.get("content") or "").upper() + "!"}
        await call(body, [*messages, reply, {"role": "user", "content": "Now add 4 to it."}])
        return {"reward": 1.0 if body["reference"] in (first.choices[0].message.content or "") else 0.0}

    @app.post("/calc")
    async def calc(body: dict) -> dict:
        return await two_calls(body, rewrite=False)

    @app.post("/drift")
    async def drift(body: dict) -> dict:
        return await two_calls(body, rewrite=True)

    @app.post("/flaky")
    async def flaky(body: dict, request: fastapi.Request) -> dict:
        if "crash" in body["prompt"]:
            raise RuntimeError("the agent crashed")
        if "slow" in body["prompt"]:
            await _until_disconnected(request)
        return await two_calls(body, rewrite=False)

    @app.post("/hang")
    async def hang(body: dict, request: fastapi.Request) -> dict:
        await call(body, list(body["messages"]))
        await log.note(hanging=1)
        await _until_disconnected(request)
        try:
            await call(body, list(body["messages"]))
            outcome = "answered"
        except openai.AuthenticationError:
            outcome = "session closed"
        async with log.changed:
            log.after_cancel.append(outcome)
            log.changed.notify_all()
        return {"reward": 0.0}

    return app


async def _until_disconnected(request: fastapi.Request) -> None:
    """Return once the caller hung up (uvicorn reports it on the request's receive channel)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@pytest.fixture(scope="module")
async def stack(smollm2_path, tmp_path_factory):
    log = AgentLog()
    agent_server = start_gateway(_agent_app(log), "127.0.0.1", 0, 1)
    url = f"http://127.0.0.1:{agent_server.port}"
    agents = {name: {"url": f"{url}/{name}", "timeout_s": 120} for name in ("calc", "drift", "hang")}
    agents["flaky"] = {"url": f"{url}/flaky", "timeout_s": 20}
    tokens = tmp_path_factory.mktemp("agent-tokens") / "tokens"
    tokens.write_text(TOKEN + "\n")
    engine = HFEngine.start(smollm2_path, dtype="float32", max_model_len=1024, max_batch_size=8)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=1024), engine)
    core = build_scorer(ScorerSettings(port=0))
    scorer = await start_scorer(ScorerSettings(port=0), core)
    experience = await start_experience(ExperienceSettings(
        port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=smollm2_path, reference_model=smollm2_path, dtype="float32", gateway_port=0,
        auth_tokens_file=tokens, gateway_call_timeout_s=120, agents=agents,
    ))
    await experience.wait_ready(120)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{experience.running.port}")
    yield experience, experience_pb2_grpc.ExperienceServiceStub(channel), log
    await channel.close()
    await experience.running.stop(1)
    await experience.close()
    await scorer.stop(1)
    await generator.stop(1)
    await core.context.close()
    await agent_server.stop()


@pytest.fixture(scope="module")
def policy(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _request(agent: str, questions: list[str], references: list[str], n: int = 2, **overrides):
    request = build_request([[{"role": "user", "content": q}] for q in questions], references=references,
                            n_samples_per_prompt=n, sampling=SamplingOptions(temperature=0.0, max_new_tokens=16),
                            **overrides)
    request.agent.name = agent
    return request


async def _stream(stub, request):
    call = stub.MakeExperiences(request, metadata=METADATA, timeout=600)
    batches = [experience_from_pb(message) async for message in call]
    return batches, dict(await call.trailing_metadata())


def _sampled_runs(row_mask: torch.Tensor, row_ids: torch.Tensor) -> list[list[int]]:
    """The row's runs of sampled ids (action_mask 1), in order: one per model call it continued."""
    runs, current = [], []
    for token, sampled in zip(row_ids.tolist(), row_mask.tolist(), strict=True):
        if sampled:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [*runs, current] if current else runs


async def test_agent_episodes_stream_as_token_exact_rows(stack, policy):
    _, stub, log = stack
    batches, _ = await _stream(stub, _request("calc", QUESTIONS, ["5", "8"], kl_coef=0.01))
    rows = [(b, i) for b in batches for i in range(len(b.reward))]
    assert len(rows) == 4 and sorted(p for b in batches for p in b.prompt_index) == [0, 0, 1, 1]
    episodes = {tuple(t for call in calls for t in call) for calls in log.sampled.values() if len(calls) == 2}
    for batch, i in rows:
        width = batch.action_mask.shape[1]
        response = batch.sequences[i, -width:]
        mask = batch.action_mask[i]
        runs = _sampled_runs(mask, response)
        assert len(runs) == 2 and tuple(t for run in runs for t in run) in episodes  # exactly the agent's ids
        assert batch.reward_metrics["num_rows"][i] == 1 and batch.reward_metrics["drift_splits"][i] == 0
        assert batch.reward[i] in (0.0, 1.0)
        sequence = batch.sequences[i][batch.attention_mask[i].bool()]
        with torch.no_grad():
            log_probs = torch.log_softmax(policy(sequence.unsqueeze(0)).logits[0], dim=-1)
        start = len(sequence) - int(batch.response_length[i])
        expected = log_probs[start - 1 : len(sequence) - 1].gather(-1, sequence[start:].unsqueeze(-1))[:, 0]
        length = int(batch.response_length[i])
        torch.testing.assert_close(batch.action_log_probs[i, :length][mask[:length]], expected[mask[:length]],
                                   atol=2e-3, rtol=0)
        assert not batch.action_log_probs[i][~mask].any() and batch.base_action_log_probs is not None


async def test_a_rewriting_agent_splits_its_episodes_and_groups_count_episodes(stack):
    _, stub, _ = stack
    batches, _ = await _stream(stub, _request("drift", QUESTIONS[:1], ["5"]))
    (batch,) = batches
    assert batch.prompt_index == (0, 0, 0, 0) and batch.sample_index == (0, 0, 1, 1)  # two rows per episode
    assert batch.reward_metrics["drift_splits"].tolist() == [1.0] * 4
    assert batch.reward[0] == batch.reward[1] and batch.reward[2] == batch.reward[3]
    rewards = batch.reward[[0, 2]]
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-9)  # group_norm over the 2 episodes, not 4 rows
    torch.testing.assert_close(batch.shaped_reward, expected.repeat_interleave(2))


async def test_a_crashed_or_slow_agent_costs_its_group_only(stack):
    _, stub, _ = stack
    questions = [QUESTIONS[0], "crash: " + QUESTIONS[1], "slow: " + QUESTIONS[1]]
    batches, trailers = await _stream(stub, _request("flaky", questions, ["5", "8", "8"]))
    assert sorted({p for b in batches for p in b.prompt_index}) == [0]
    assert trailers["fastexp-failed-groups"] == "2" and trailers[FAILED_KEY] == "1,2"


async def test_a_cancelled_stream_ends_its_agent_sessions(stack):
    experience, stub, log = stack
    before = len(log.after_cancel)
    call = stub.MakeExperiences(_request("hang", QUESTIONS[:1], ["5"]), metadata=METADATA, timeout=600)
    await log.wait_for(lambda s: s.hanging == 2)  # both episodes made a call and wait
    call.cancel()
    await log.wait_for(lambda s: len(s.after_cancel) == before + 2)
    assert log.after_cancel[before:] == ["session closed"] * 2 and len(experience.sessions) == 0


@pytest.mark.parametrize(("change", "field"), [
    ({"name": "nobody"}, "agent.name"),
    ({"name": ""}, "agent.name"),
])
async def test_bad_agent_options_are_refused_naming_the_field(stack, change, field):
    _, stub, _ = stack
    request = _request("calc", QUESTIONS[:1], ["5"])
    request.agent.name = change["name"]
    request.agent.max_calls = 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _stream(stub, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()


async def test_an_agent_with_an_environment_or_cpgd_is_refused(stack):
    _, stub, _ = stack
    with_environment = _request("calc", QUESTIONS[:1], ["5"])
    with_environment.environment = "math_feedback"
    with_cpgd = _request("calc", QUESTIONS[:1], ["5"], advantage_estimator="cpgd")
    for request, field in ((with_environment, "agent"), (with_cpgd, "advantage_estimator")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _stream(stub, request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()

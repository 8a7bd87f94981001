"""The calculator agent example (examples/agent_calculator.py) against a real gateway: its evaluator on good and
hostile input; its agent server driven over HTTP with a session of the experience service's gateway (three services
in process, SmolLM2 on the HF backend, one stack for the module): every reply the agent received is what the model
sampled in the session's recorded rows, decoded; and the demo's stream (MakeExperiences with agent=calculator):
every row's sampled turns, decoded, are the replies one of the agent's episodes received, rewards are 0 or 1, and
the rows of an episode are consecutive and share prompt_index and sample_index."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from fastexp.types import turn_spans
from services.experience.gateway.messages import Message, ToolCall, parse_reply
from services.experience.gateway.recording import rows_of
from services.experience.gateway.serving import start_gateway
from tests.support.stack import three_services

pytestmark = [pytest.mark.smollm2]

MODEL = "smollm2-policy"
MAX_CALLS = 3
EXAMPLE_PATH = Path(__file__).resolve().parents[2] / "examples" / "agent_calculator.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("agent_calculator", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the request models' annotations through it
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.mark.parametrize(("expression", "value"), [
    ("2+3*4", 14), ("(1+2)**3", 27), ("7/2", 3.5), ("-3 - -2", -1), ("2**-1", 0.5), (" 12*24 - 150 ", 138),
    ("1.5*4", 6.0),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert example.calculate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os')", "__import__('os').system('true')", "(1).__class__", "open('/etc/passwd')", "x + 1",
    "'a' * 3", "[1] * 3", "True + 1", "lambda: 1", "9**9**9", "10**1000", "2**-101", "(10**60) * (10**60)",
    "1e400", "1/0", "(-8)**0.5", "1 +", "2" * 201, "(" * 150 + "1" + ")" * 150,
])
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(example.CalculatorError):
        example.calculate(expression)


def test_tool_calls_answer_with_results_or_errors():
    assert example.run_tool("calculator", '{"expression": "12*24-150"}') == "138"
    assert example.run_tool("calculator", '{"expression": "6/4"}') == "1.5"
    assert example.run_tool("calculator", '{"expression": "__import__(\'os\')"}').startswith("error: not arithmetic")
    for name, arguments in [("calculator", "not json"), ("calculator", "[1]"), ("calculator", '{"expr": "1"}'),
                            ("shell", '{"expression": "1"}')]:
        assert example.run_tool(name, arguments).startswith("error:")


def test_the_reward_is_math_verify_on_the_final_answer():
    assert example.reward("12*24 = 288, 288 - 150 = 138, so \\boxed{138}", "138") == 1.0
    assert example.reward("\\boxed{137}", "138") == 0.0
    assert example.reward("", "138") == 0.0


@pytest.fixture(scope="module")
def transcripts() -> list[dict]:
    return []


@pytest.fixture(scope="module")
async def stack(smollm2_path, transcripts):
    """The three services in process, the gateway on and the example's agent server named ``calculator``."""
    agent = start_gateway(example.agent_app(max_calls=MAX_CALLS, max_tokens=96, transcripts=transcripts),
                          "127.0.0.1", 0, 1)
    url = f"http://127.0.0.1:{agent.port}/episode"
    experience = {"gateway_port": 0, "gateway_model_name": MODEL, "gateway_call_timeout_s": 600,
                  "agents": {"calculator": {"url": url, "timeout_s": 600}}}
    async with three_services(smollm2_path, engine={"max_model_len": 1024, "max_batch_size": 8},
                              generator={"max_model_len": 1024}, experience=experience, ready_timeout_s=120) as services:
        yield services, url
    await agent.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _episode_body(question: str, reference: str, base_url: str, key: str) -> dict:
    """The body the experience service POSTs (services/experience/gateway/agents.py)."""
    return {"episode_id": "episode-1", "messages": [{"role": "user", "content": question}], "prompt": question,
            "reference": reference, "label": "", "session": {"base_url": base_url, "api_key": key, "model": MODEL}}


def received(sampled_text: str, reply: dict) -> bool:
    """Whether ``sampled_text`` (a turn's sampled ids, decoded without special tokens) is the reply the agent
    received: the same text when it made no tool call, else the same content and calls once its tool-call blocks
    are read."""
    if not reply["tool_calls"]:
        return sampled_text == reply["content"]
    calls = tuple(ToolCall(name, arguments) for name, arguments in reply["tool_calls"])
    return parse_reply(sampled_text) == Message("assistant", reply["content"], calls)


async def test_the_agent_server_answers_an_episode_through_the_gateway(stack, transcripts, tokenizer):
    services, url = stack
    experience = services.experience
    question, reference = example.PROBLEMS[0]
    session = experience.sessions.open(MODEL, timeout_s=600, max_calls=MAX_CALLS)
    async with httpx.AsyncClient() as client:
        response = await client.post(url, json=_episode_body(question, reference, experience.gateway.base_url,
                                                              session.key), timeout=600)
    calls = experience.sessions.close(session)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["reward"] in (0.0, 1.0) and set(answer["metrics"]) == {"tool_calls", "tool_errors"}
    (transcript,) = [t for t in transcripts if t["messages"][0]["content"] == question]
    replies = transcript["replies"]
    assert 1 <= len(calls) == len(replies) <= MAX_CALLS
    assert answer["metrics"]["tool_calls"] == sum(len(r["tool_calls"]) for r in replies)
    sampled = [s for row in rows_of(calls) for s in row.segments if s.sampled]  # rows in call order
    assert len(sampled) == len(replies)
    for segment, reply in zip(sampled, replies, strict=True):
        assert received(tokenizer.decode(segment.token_ids, skip_special_tokens=True), reply)


async def test_an_agent_with_a_closed_session_fails_its_episode(stack):
    services, url = stack
    experience = services.experience
    session = experience.sessions.open(MODEL, timeout_s=600)
    experience.sessions.close(session)  # the key is unknown now: the gateway answers 401, the agent fails
    async with httpx.AsyncClient() as client:
        response = await client.post(url, json=_episode_body("1+1?", "2", experience.gateway.base_url, session.key),
                                     timeout=600)
    assert response.status_code == 500


def _sampled_turns(batch, row: int, tokenizer) -> list[str]:
    """The row's model turns (the runs of action_mask 1), each decoded without special tokens."""
    length = int(batch.response_length[row])
    response = batch.sequences[row, -batch.action_mask.shape[1]:][:length]
    return [tokenizer.decode(response[start:end].tolist(), skip_special_tokens=True)
            for start, end in turn_spans(batch.action_mask[row, :length])]


async def test_the_demo_streams_the_agents_episodes_as_its_rows(stack, transcripts, tokenizer):
    services, _ = stack
    problems, n = example.PROBLEMS[1:3], 2
    before = len(transcripts)
    # the demo's stream, through the fastexp client (blocking: in a thread, the agent server runs in this loop)
    batches = await asyncio.to_thread(
        lambda: list(example.stream_batches(services.experience_address, problems, n, MAX_CALLS)))
    episodes = defaultdict(list)  # prompt_index -> the replies of each episode the agent ran for it
    for transcript in transcripts[before:]:
        prompt = next(i for i, (q, _) in enumerate(problems) if transcript["messages"][0]["content"] == q)
        episodes[prompt].append(transcript["replies"])
    samples = []  # (prompt_index, sample_index) per row, in stream order
    turns = defaultdict(list)  # (prompt_index, sample_index) -> the sample's decoded model turns, rows in order
    num_rows = {}  # (prompt_index, sample_index) -> its episode's rows, as the service counted them
    for batch in batches:
        metrics = batch.reward_metrics
        for row, key in enumerate(zip(batch.prompt_index, batch.sample_index, strict=True)):
            assert batch.reward[row] in (0.0, 1.0)
            assert metrics["num_rows"][row] == 1 + metrics["drift_splits"][row]  # a drift starts a row
            samples.append(key)
            turns[key] += _sampled_turns(batch, row, tokenizer)
            num_rows[key] = int(metrics["num_rows"][row])
    assert sorted(set(samples)) == [(p, s) for p in range(len(problems)) for s in range(n)]
    assert {key: samples.count(key) for key in num_rows} == num_rows  # an episode's rows all arrived
    # an episode's rows are consecutive: a sample's key never comes back after another's
    assert [key for i, key in enumerate(samples) if i == 0 or samples[i - 1] != key] == list(dict.fromkeys(samples))
    for (prompt, _), decoded in turns.items():  # each sample is one of the agent's episodes, token for token
        match = next((replies for replies in episodes[prompt] if len(replies) == len(decoded) and all(
            received(text, reply) for text, reply in zip(decoded, replies, strict=True))), None)
        assert match is not None, f"no episode of prompt {prompt} received {decoded}"
        episodes[prompt].remove(match)

"""The calculator agent example (examples/agent_calculator.py) against a real gateway: its evaluator on good and
hostile input, and its agent server driven over HTTP with a session of the experience service's gateway (three
services in process, SmolLM2 on the HF backend, one stack for the module): every reply the agent received is what
the model sampled in the session's recorded rows, decoded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from services.experience.gateway.messages import Message, ToolCall, parse_reply
from services.experience.gateway.recording import rows_of
from services.experience.gateway.serving import start_gateway
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings

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
    agent = start_gateway(example.agent_app(max_calls=MAX_CALLS, max_tokens=96, transcripts=transcripts),
                          "127.0.0.1", 0, 1)
    agents = {"calculator": {"url": f"http://127.0.0.1:{agent.port}/episode", "timeout_s": 600}}
    engine = HFEngine.start(smollm2_path, dtype="float32", max_model_len=2048, max_batch_size=8)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=2048), engine)
    core = build_scorer(ScorerSettings(port=0))
    scorer = await start_scorer(ScorerSettings(port=0), core)
    experience = await start_experience(ExperienceSettings(
        port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=smollm2_path, reference_model=smollm2_path, dtype="float32", gateway_port=0,
        gateway_model_name=MODEL, gateway_call_timeout_s=600, agents=agents,
    ))
    await experience.wait_ready(120)
    yield experience, f"http://127.0.0.1:{agent.port}/episode"
    await experience.running.stop(1)
    await experience.close()
    await scorer.stop(1)
    await generator.stop(1)
    await core.context.close()
    await agent.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _episode_body(question: str, reference: str, base_url: str, key: str) -> dict:
    """The body the experience service POSTs (services/experience/gateway/agents.py)."""
    return {"episode_id": "episode-1", "messages": [{"role": "user", "content": question}], "prompt": question,
            "reference": reference, "label": "", "session": {"base_url": base_url, "api_key": key, "model": MODEL}}


def assert_received(sampled_text: str, reply: dict) -> None:
    """``sampled_text`` (a turn's sampled ids, decoded without special tokens) is the reply the agent received:
    the same text when it made no tool call, else the same content and calls once its tool-call blocks are read."""
    if not reply["tool_calls"]:
        assert sampled_text == reply["content"]
    calls = tuple(ToolCall(name, arguments) for name, arguments in reply["tool_calls"])
    assert parse_reply(sampled_text) == Message("assistant", reply["content"], calls)


async def test_the_agent_server_answers_an_episode_through_the_gateway(stack, transcripts, tokenizer):
    experience, url = stack
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
        assert_received(tokenizer.decode(segment.token_ids, skip_special_tokens=True), reply)


async def test_an_agent_with_a_closed_session_fails_its_episode(stack):
    experience, url = stack
    session = experience.sessions.open(MODEL, timeout_s=600)
    experience.sessions.close(session)  # the key is unknown now: the gateway answers 401, the agent fails
    async with httpx.AsyncClient() as client:
        response = await client.post(url, json=_episode_body("1+1?", "2", experience.gateway.base_url, session.key),
                                     timeout=600)
    assert response.status_code == 500

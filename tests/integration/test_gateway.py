"""The OpenAI-compatible gateway on the real experience service, called with the official ``openai`` client: chat
(plain, streaming, with tools in the conversation), completions with vLLM's ``return_token_ids``, OpenAI-shaped
errors naming the field, bearer tokens and session keys; and a session's recording: a conversation that extends
the previous call continues its row token-exactly (the sampled ids kept, their log-probs an independent forward's),
one whose history was re-rendered is a drift that starts a new row. SmolLM2 (HF backend), greedy."""

from __future__ import annotations

import fastapi
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.deadlines import Deadline
from services.common.errors import EpisodeFailed
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

TOKEN = "gateway-test-token"
MODEL = "smollm2-policy"
QUESTION = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]


def _agent_app() -> fastapi.FastAPI:
    """An agent server as a user would write one: the official client, two model calls per episode; ``/drift``
    re-renders the history like a framework that rewrites it, ``/crash`` fails."""
    app = fastapi.FastAPI()

    async def two_calls(body: dict, rewrite: bool) -> dict:
        session = body["session"]
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        messages = list(body["messages"])
        first = await client.chat.completions.create(model=session["model"], messages=messages, max_tokens=24,
                                                     temperature=0)
        reply = first.choices[0].message.model_dump(exclude_none=True)
        if rewrite:
            reply = {"role": "assistant", "content": (reply.get("content") or "").upper() + "!"}
        messages += [reply, {"role": "user", "content": "Now add 4 to it."}]
        await client.chat.completions.create(model=session["model"], messages=messages, max_tokens=24, temperature=0)
        return {"reward": 1.0 if body["reference"] in (first.choices[0].message.content or "") else 0.0,
                "metrics": {"calls": 2}}

    @app.post("/calc")
    async def calc(body: dict) -> dict:
        return await two_calls(body, rewrite=False)

    @app.post("/drift")
    async def drift(body: dict) -> dict:
        return await two_calls(body, rewrite=True)

    @app.post("/crash")
    async def crash(body: dict) -> dict:
        raise RuntimeError("the agent crashed")

    return app


@pytest.fixture(scope="module")
async def stack(smollm2_path, tmp_path_factory):
    agent_server = start_gateway(_agent_app(), "127.0.0.1", 0, 1)
    agents = {name: {"url": f"http://127.0.0.1:{agent_server.port}/{name}", "timeout_s": 120}
              for name in ("calc", "drift", "crash")}
    tokens = tmp_path_factory.mktemp("gateway-tokens") / "tokens"
    tokens.write_text(TOKEN + "\n")
    engine = HFEngine.start(smollm2_path, dtype="float32", max_model_len=1024, max_batch_size=8)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=1024), engine)
    core = build_scorer(ScorerSettings(port=0))
    scorer = await start_scorer(ScorerSettings(port=0), core)
    experience = await start_experience(ExperienceSettings(
        port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=smollm2_path, reference_model=smollm2_path, dtype="float32", gateway_port=0,
        gateway_model_name=MODEL, auth_tokens_file=tokens, gateway_call_timeout_s=120, agents=agents,
    ))
    await experience.wait_ready(120)
    yield experience
    await experience.running.stop(1)
    await experience.close()
    await scorer.stop(1)
    await generator.stop(1)
    await core.context.close()
    await agent_server.stop()


def _client(stack, key=TOKEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway.base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


async def test_chat_and_completions_through_the_openai_client(stack, tokenizer):
    client = _client(stack)
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    reply = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = reply.choices[0]
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    expected_prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert reply.model == MODEL and reply.model_extra["prompt_token_ids"] == list(expected_prompt)
    ids = choice.model_extra["token_ids"]
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(choice.logprobs.content) == len(ids) == reply.usage.completion_tokens
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)

    completion = await client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1,
        extra_body={"return_token_ids": True},
    )
    text_choice = completion.choices[0]
    assert text_choice.text == tokenizer.decode(text_choice.model_extra["token_ids"], skip_special_tokens=True)
    assert len(text_choice.logprobs.token_logprobs) == len(text_choice.model_extra["token_ids"])


async def test_a_stream_carries_the_same_reply_as_a_plain_call(stack):
    client = _client(stack)
    plain = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason and usage == plain.usage


async def test_tools_and_tool_messages_render_with_the_template(stack, tokenizer):
    tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                                "parameters": {"type": "object", "properties": {
                                                    "expression": {"type": "string"}}}}}]
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    reply = await _client(stack).chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = tokenizer.decode(reply.model_extra["prompt_token_ids"])
    # SmolLM2's template has no tool calls: they are written Hermes-style into the assistant turn
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression":"2+3"}}\n</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 5), ("stop", ["\n"]), ("n", 0), ("messages", []), ("top_logprobs", 3), ("tool_choice", "required"),
])
async def test_bad_input_is_400_naming_the_field(stack, field, value):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, field: value}
    if field == "tool_choice":
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await _client(stack).chat.completions.create(**body)
    assert caught.value.body["param"] == field and caught.value.body["type"] == "invalid_request_error"


async def test_unknown_keys_are_401_and_unknown_models_404(stack):
    for key in ("not-a-token", "fxs-never-issued"):
        with pytest.raises(openai.AuthenticationError):
            await _client(stack, key).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    expired = stack.sessions.open("run-x", timeout_s=0)
    with pytest.raises(openai.AuthenticationError):
        await _client(stack, expired.key).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        await _client(stack).chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=4)


async def test_a_session_records_token_exact_rows_and_splits_on_drift(stack, tokenizer, smollm2_path):
    session = stack.sessions.open("run-a", timeout_s=300, max_calls=3)
    client = _client(stack, session.key)
    messages = list(QUESTION)
    first = await client.chat.completions.create(model="anything", messages=messages, max_tokens=24, temperature=0)
    assert first.model == "run-a" and first.choices[0].finish_reason == "stop"
    messages += [first.choices[0].message.model_dump(exclude_none=True),  # as agents append the reply
                 {"role": "user", "content": "Now add 4 to it."}]
    second = await client.chat.completions.create(model="anything", messages=messages, max_tokens=24, temperature=0)
    # a framework that re-renders history: the first reply rewritten
    rewritten = [*QUESTION, {"role": "assistant", "content": "five"}, {"role": "user", "content": "Now add 4."}]
    await client.chat.completions.create(model="anything", messages=rewritten, max_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError) as caught:  # max_calls = 3
        await client.chat.completions.create(model="anything", messages=rewritten, max_tokens=8)
    assert caught.value.body["param"] == "max_calls"
    calls = stack.sessions.close(session)
    assert [c.row for c in calls] == [0, 0, 1] and session.drifts == 1
    rows = rows_of(calls)
    assert len(rows) == 2 and rows[0].num_turns == 2
    row = rows[0]
    sampled = [s for s in row.segments if s.sampled]
    assert [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in sampled] == [
        first.choices[0].message.content, second.choices[0].message.content]
    ids = [*row.prompt_ids, *(t for s in row.segments for t in s.token_ids)]
    assert tuple(ids[: len(calls[1].prompt_ids)]) == calls[1].prompt_ids  # call 2 saw call 1's sampled ids
    assert tokenizer.decode(row.segments[1].token_ids) == "\n<|im_start|>user\nNow add 4 to it.<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    position = len(row.prompt_ids)
    for segment in row.segments:
        if segment.sampled:
            positions = torch.arange(position - 1, position - 1 + len(segment.token_ids))
            expected = log_probs[positions].gather(-1, torch.tensor(segment.token_ids).unsqueeze(-1))[:, 0]
            torch.testing.assert_close(torch.tensor(segment.log_probs), expected, atol=2e-3, rtol=0)
        position += len(segment.token_ids)


async def _episode(stack, name):
    return await stack.agents.run_episode(name, QUESTION, QUESTION[0]["content"], "5", "", 0, 1,
                                          Deadline.from_remaining(300))


async def test_an_agent_episode_is_one_token_exact_row_and_a_rewriting_agent_splits(stack, tokenizer):
    episode = await _episode(stack, "calc")
    assert episode.metrics["num_rows"] == 1 and episode.metrics["drift_splits"] == 0 and episode.metrics["num_calls"] == 2
    (row,) = episode.rows
    assert row.num_turns == 2 and row.sample_index == 1 and len(row.action_mask) == len(row.output_token_ids)
    observation = [t for t, m in zip(row.output_token_ids, row.action_mask, strict=True) if not m]
    assert tokenizer.decode(observation) == "\n<|im_start|>user\nNow add 4 to it.<|im_end|>\n<|im_start|>assistant\n"
    assert all(p == 0 for p, m in zip(row.output_log_probs, row.action_mask, strict=True) if not m)
    drifted = await _episode(stack, "drift")
    assert drifted.metrics["num_rows"] == 2 and drifted.metrics["drift_splits"] == 1
    assert [r.num_turns for r in drifted.rows] == [1, 1]


async def test_a_crashed_agent_fails_its_episode_and_its_session_ends(stack):
    before = len(stack.sessions)
    with pytest.raises(EpisodeFailed, match="crash.*HTTP 500"):
        await _episode(stack, "crash")
    assert len(stack.sessions) == before

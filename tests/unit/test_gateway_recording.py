"""The gateway's pure parts: replies parsed into tool calls, calls planned as continuations or drifts, rows built
from the recorded calls (hand-made records)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.experience.gateway.messages import Message, ToolCall, parse_messages, parse_reply
from services.experience.gateway.recording import CallRecord, Choice, Continue, Fresh, plan_call, rows_of
from services.experience.gateway.requests import parse_chat

USER = Message("user", "2+3?")


def test_a_reply_with_a_hermes_block_is_a_tool_call_and_malformed_blocks_stay_text():
    reply = parse_reply('Let me compute.<tool_call>\n{"name": "calc", "arguments": {"b": 1, "a": "2"}}\n</tool_call>')
    assert reply == Message("assistant", "Let me compute.", (ToolCall("calc", '{"a":"2","b":1}'),))
    assert parse_reply("<tool_call>not json</tool_call>").tool_calls == ()
    # the client's echo of the reply (arguments re-spaced, ids added, content None) is the same message
    echoed = parse_messages([{"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "calc", "arguments": '{"b": 1, "a": "2"}'}}]}])
    assert echoed == (reply,)


def _call(messages, reply, ids, row=0, parent=None, finish="stop"):
    choice = Choice(reply, ids, (-0.5,) * len(ids), finish, 3)
    return CallRecord(tuple(messages), (1, 2), (choice,), row, parent)


def test_plan_continues_a_row_only_when_the_history_and_the_reply_are_unchanged():
    reply = Message("assistant", "5")
    calls = [_call([USER], reply, (7, 8))]
    tool = Message("tool", "5")
    assert plan_call([], [USER]) == Fresh("first")
    assert plan_call(calls, [USER, reply, tool]) == Continue(0, 0, (tool,))
    assert plan_call(calls, [USER, Message("assistant", "five"), tool]) == Fresh("reply rewritten")
    assert plan_call(calls, [Message("user", "2 + 3?"), reply, tool]) == Fresh("history rewritten")
    assert plan_call(calls, [USER, reply, Message("assistant", "more")]).drift
    cut = [_call([USER], reply, (7,), finish="length")]
    assert plan_call(cut, [USER, reply, tool]) == Fresh("reply cut off")


def test_rows_keep_sampled_ids_with_their_log_probs_and_mask_the_rendered_ones():
    reply = Message("assistant", "5")
    first = _call([USER], reply, (7, 8))
    second = CallRecord((USER, reply, Message("user", "+4")), (1, 2, 7, 8, 30, 31),
                        (Choice(Message("assistant", "9"), (9,), (-0.25,), "stop", 4),), 0, (0, 0))
    drifted = _call([USER, Message("assistant", "x")], reply, (5,), row=1)
    rows = rows_of([first, second, drifted])
    assert len(rows) == 2 and rows[0].num_turns == 2 and rows[1].num_turns == 1
    segments = rows[0].segments
    assert [(s.token_ids, s.sampled) for s in segments] == [((7, 8), True), ((30, 31), False), ((9,), True)]
    assert segments[1].log_probs == (0.0, 0.0) and segments[2].log_probs == (-0.25,)


def test_a_sampling_value_the_record_refuses_is_a_bad_request_naming_the_openai_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequest) as caught:
        parse_chat({**body, "seed": 2**64})  # past the wire's uint64
    assert caught.value.field == "seed"
    assert parse_chat({**body, "seed": 7}).generation.sampling.seed == 7

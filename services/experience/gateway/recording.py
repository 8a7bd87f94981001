"""What a session's calls recorded, and how they become token-exact rows: pure functions over immutable records.

Every call through a session is a :class:`CallRecord`: the request's messages, the prompt ids the model was given,
and each choice's reply and sampled ids. :func:`plan_call` decides how the next call's prompt is built:

- **continue** (:class:`Continue`): its messages are a row's last call's messages, then one of that call's replies
  exactly, then only user/tool messages. The prompt is that call's prompt ids + the reply's sampled ids + the new
  messages as the template renders them: nothing the model sampled is re-encoded.
- **fresh** (:class:`Fresh`): anything else (the first call; a framework that rewrote, trimmed or re-rendered the
  history; an edited reply; a reply cut off at ``max_tokens``; a branch from an older call). The template renders
  the whole conversation and a new row starts; ``reason`` says why, and a fresh call after the first is a *drift*.

:func:`rows_of` turns the calls into rows: each row a prompt and its segments, sampled (``action_mask`` 1, the
engine's log-probs) or rendered (0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.experience.gateway.messages import Message


@dataclass(frozen=True)
class Choice:
    """One sampled reply: the message it stands for, its ids and log-probs (nats), why it ended."""

    reply: Message
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str  # "stop" (end of turn), "length", "abort"
    policy_version: int


@dataclass(frozen=True)
class CallRecord:
    """One chat call of a session: its ``messages``, the ``prompt_ids`` the model saw, its ``choices``; ``row`` the
    row it belongs to, ``parent`` (row continuations) the (call index, choice) it continued."""

    messages: tuple[Message, ...]
    prompt_ids: tuple[int, ...]
    choices: tuple[Choice, ...]
    row: int
    parent: tuple[int, int] | None = None


@dataclass(frozen=True)
class Continue:
    """Continue the row of call ``call``'s choice ``choice``: ``appended`` are the messages after its reply."""

    call: int
    choice: int
    appended: tuple[Message, ...]


@dataclass(frozen=True)
class Fresh:
    """Render the whole conversation; a new row. ``reason``: ``first`` or why the row could not continue."""

    reason: str

    @property
    def drift(self) -> bool:
        return self.reason != "first"


@dataclass(frozen=True)
class Segment:
    """Ids in a row after its prompt: ``sampled`` (the model's, with their log-probs) or rendered (0s)."""

    token_ids: tuple[int, ...]
    sampled: bool
    log_probs: tuple[float, ...]
    policy_version: int | None = None


@dataclass(frozen=True)
class Row:
    """One token-exact row: ``prompt_ids`` and the ``segments`` after them; ``finish_reason`` its last reply's."""

    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    finish_reason: str
    num_turns: int


def _tips(calls: Sequence[CallRecord]) -> dict[int, int]:
    """Row -> the index of its last call."""
    return {call.row: index for index, call in enumerate(calls)}


def plan_call(calls: Sequence[CallRecord], messages: Sequence[Message]) -> Continue | Fresh:
    """How a call with ``messages`` builds its prompt, given the session's calls so far (module docs)."""
    if not calls:
        return Fresh("first")
    reason = "history rewritten"  # no row's messages are a prefix of these
    for index in sorted(_tips(calls).values(), reverse=True):  # the most recent row first
        call, known = calls[index], len(calls[index].messages)
        if tuple(messages[:known]) != call.messages:
            continue
        if len(messages) == known:
            reason = "no reply appended"
            continue
        for choice_index, choice in enumerate(call.choices):
            if messages[known] != choice.reply:
                continue
            appended = tuple(messages[known + 1:])
            if choice.finish_reason != "stop":
                return Fresh("reply cut off")
            if not appended or any(m.role not in ("user", "tool") for m in appended):
                return Fresh("appended messages are not user or tool messages")
            return Continue(index, choice_index, appended)
        reason = "reply rewritten"
    return Fresh(reason)


def rows_of(calls: Sequence[CallRecord]) -> tuple[Row, ...]:
    """The session's rows, in order of their first call: each call's continued choice (the first choice of a row's
    last call) as sampled segments, the rendered messages between them as the others."""
    rows: dict[int, Row] = {}
    for index, call in enumerate(calls):
        continued = {c.parent for c in calls[index + 1:] if c.parent is not None and c.parent[0] == index}
        choice = call.choices[min((p[1] for p in continued), default=0)]
        sampled = Segment(choice.token_ids, True, choice.log_probs, choice.policy_version)
        if call.parent is None:
            rows[call.row] = Row(call.prompt_ids, (sampled,), choice.finish_reason, 1)
            continue
        row = rows[call.row]
        known = len(row.prompt_ids) + sum(len(s.token_ids) for s in row.segments)
        rendered = call.prompt_ids[known:]
        rows[call.row] = Row(row.prompt_ids, (*row.segments, Segment(rendered, False, (0.0,) * len(rendered)), sampled),
                             choice.finish_reason, row.num_turns + 1)
    return tuple(rows[r] for r in sorted(rows))

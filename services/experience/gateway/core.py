"""The gateway's core: a chat or completion call turned into generation over the fleet, recorded when it belongs to
a session. No HTTP here (:mod:`~services.experience.gateway.app` is the edge).

A session call is planned (:func:`~services.experience.gateway.recording.plan_call`) under the session's lock: it
continues a row token-exactly or starts a new one (drift, counted), is generated, and its record is appended.
Every generation has a deadline: the gateway's ``call_timeout_s``, and for a session no later than its expiry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.deadlines import Deadline
from services.common.errors import InvalidRequest
from services.common.generation import CompletionRecord, GenerationRequest
from services.experience.gateway.messages import Message, parse_reply
from services.experience.gateway.recording import CallRecord, Choice, Continue, plan_call
from services.experience.gateway.rendering import ChatRenderer
from services.experience.gateway.requests import ChatRequest, CompletionRequest, Generation
from services.experience.gateway.sessions import GATEWAY_CALLS, Session
from services.experience.pipeline.events import Generator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """A call's result: the model named in the answer, the prompt ids, and the choices in order."""

    model: str
    prompt_ids: tuple[int, ...]
    choices: tuple[Choice, ...]


class Gateway:
    """Chat and completion calls over a :class:`Generator` (module docs). ``max_model_len()`` is read per call
    (raises ``NotReady`` while the generator is not ready)."""

    def __init__(self, generator: Generator, tokenizer: Any, model_name: str, max_model_len: Callable[[], int],
                 call_timeout_s: float) -> None:
        self._generator = generator
        self._tokenizer = tokenizer
        self._renderer = ChatRenderer(tokenizer)
        self.model_name = model_name
        self._max_model_len = max_model_len
        self._call_timeout_s = call_timeout_s
        self._ids = itertools.count()

    async def chat(self, request: ChatRequest, session: Session | None) -> Answer:
        """One chat call; recorded in ``session`` when given.

        Raises:
            InvalidRequest: the messages cannot be rendered, do not fit the model, or the session's ``max_calls``
                was reached.
            NotReady, UpstreamTimeout: from the generator.
        """
        if session is None:
            ids = self._renderer.prompt_ids(request.messages, request.tools)
            choices = await self._generate(ids, request.generation, None, None)
            return Answer(self.model_name, tuple(ids), choices)
        async with session.lock:
            session.check_room()
            plan = plan_call(session.calls, request.messages)
            if isinstance(plan, Continue):
                parent = session.calls[plan.call]
                choice = parent.choices[plan.choice]
                ids = [*parent.prompt_ids, *choice.token_ids, *self._renderer.continuation_ids(plan.appended,
                                                                                              request.tools)]
                row, origin = parent.row, (plan.call, plan.choice)
            else:
                ids = self._renderer.prompt_ids(request.messages, request.tools)
                row, origin = len({c.row for c in session.calls}), None
                if plan.drift:
                    session.drifts += 1
                    logger.info("gateway session %s: drift (%s), new row %d", session.name, plan.reason, row)
            GATEWAY_CALLS.labels("continued" if origin else "drift" if plan.drift else "fresh").inc()
            choices = await self._generate(ids, request.generation, session, row)
            session.calls.append(CallRecord(request.messages, tuple(ids), choices, row, origin))
        return Answer(session.model, tuple(ids), choices)

    async def complete(self, request: CompletionRequest) -> Answer:
        """One completion call (not recorded): a string prompt is tokenized as is (no chat template)."""
        prompt = request.prompt
        ids = list(prompt) if isinstance(prompt, tuple) else list(
            self._tokenizer(prompt, add_special_tokens=False)["input_ids"])
        vocabulary = len(self._tokenizer)
        if any(i >= vocabulary for i in ids):
            raise InvalidRequest("prompt", f"token ids must be below the vocabulary size {vocabulary}")
        choices = await self._generate(ids, request.generation, None, None)
        return Answer(self.model_name, tuple(ids), choices)

    def decode_text(self, token_ids: tuple[int, ...]) -> str:
        """The completion's text, special tokens skipped."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def decode(self, token_ids: tuple[int, ...]) -> list[str]:
        """Each token as text (special tokens included), for log-prob entries."""
        return [self._tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    async def _generate(self, ids: list[int], generation: Generation, session: Session | None,
                        row: int | None) -> tuple[Choice, ...]:
        room = self._max_model_len() - len(ids)
        if room < 1:
            raise InvalidRequest("messages", f"the conversation is {len(ids)} tokens; the model takes "
                                             f"{self._max_model_len()} in all")
        budget = min(generation.max_tokens or room, room)
        timeout = self._call_timeout_s if session is None else min(self._call_timeout_s, session.remaining_s())
        request = GenerationRequest(
            request_id=f"gateway-{next(self._ids)}" + (f"-{session.name}" if session else ""), prompts=(tuple(ids),),
            sampling=dataclasses.replace(generation.sampling, max_new_tokens=budget),
            n_samples_per_prompt=generation.n,
            affinity_key=None if session is None else f"gateway/{session.name}/{row}",  # the row's KV stays put
        )
        records: list[CompletionRecord] = []
        async with contextlib.aclosing(self._generator.generate(request, Deadline.from_remaining(timeout))) as stream:
            async for record in stream:
                if isinstance(record, CompletionRecord):
                    records.append(record)
        records.sort(key=lambda r: r.sample_index)
        return tuple(self._choice(record) for record in records)

    def _choice(self, record: CompletionRecord) -> Choice:
        text = self._tokenizer.decode(record.output_token_ids, skip_special_tokens=True)
        reply: Message = parse_reply(text)
        return Choice(reply, tuple(record.output_token_ids), tuple(float(x) for x in record.output_log_probs),
                      record.finish_reason, record.policy_version)

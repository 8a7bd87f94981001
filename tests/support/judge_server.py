"""An OpenAI-compatible chat completions server playing an LLM judge, for the judge tests (FastAPI; serve it with
:func:`tests.support.http_servers.serving`).

``POST /{mode}/v1/chat/completions``, the judged answer read from the user message's ``Answer: ...`` line:

- ``ok``: ``\\boxed{len(answer) % 10}``; an answer starting with ``garbage`` gets a reply without a verdict; with
  ``logprobs`` asked, the first token's candidates are ``Yes`` (0.8) and ``No`` (0.2);
- ``flaky``: HTTP 503 while ``state.down``, else as ``ok``;
- ``faulty``: HTTP 500 for an answer starting with ``fail``, else as ``ok``;
- ``hang``: never answers; waits until the client closes the connection.

:class:`JudgeLog` (``app.state.log``) counts requests started, answered and ended, the peak in flight, and the
connections clients closed before an answer; tests wait on it (a condition), never on time.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class JudgeLog:
    """What the judge server saw, guarded by a condition that tests wait on (thread-safe)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.started = self.answered = self.ended = self.disconnected = self.in_flight = self.peak = 0

    def update(self, change: Callable[[JudgeLog], None]) -> None:
        with self._condition:
            change(self)
            self.peak = max(self.peak, self.in_flight)
            self._condition.notify_all()

    def wait_for(self, predicate: Callable[[JudgeLog], bool], timeout_s: float = 60.0) -> None:
        """Block until ``predicate(self)`` holds. Raises TimeoutError after ``timeout_s``."""
        with self._condition:
            if not self._condition.wait_for(lambda: predicate(self), timeout_s):
                raise TimeoutError(f"judge server: condition not met (started {self.started}, ended {self.ended})")


def _answer(user: str) -> str:
    match = re.search(r"^Answer: (.*)$", user, re.MULTILINE)
    return match.group(1) if match else user


def _completion(body: dict) -> dict:
    answer = _answer(body["messages"][-1]["content"])
    content = "I cannot judge this." if answer.startswith("garbage") else f"Judged. \\boxed{{{len(answer) % 10}}}"
    choice: dict = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if body.get("logprobs"):
        candidates = [{"token": "Yes", "logprob": math.log(0.8)}, {"token": "No", "logprob": math.log(0.2)}]
        choice["logprobs"] = {"content": [{"token": "Yes", "logprob": math.log(0.8), "top_logprobs": candidates}]}
    usage = {"prompt_tokens": len(body["messages"][-1]["content"].split()), "completion_tokens": 3}
    return {"id": "judge", "object": "chat.completion", "model": body.get("model", ""), "choices": [choice],
            "usage": usage}


def judge_app() -> FastAPI:
    """The judge server (module docs); ``app.state.log`` and ``app.state.down`` are the tests' handles."""
    app = FastAPI()
    app.state.log = JudgeLog()
    app.state.down = True
    log: JudgeLog = app.state.log

    @app.post("/{mode}/v1/chat/completions")
    async def complete(mode: str, request: Request):
        body = await request.json()
        log.update(lambda s: setattr(s, "started", s.started + 1) or setattr(s, "in_flight", s.in_flight + 1))
        try:
            if mode == "hang":
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                log.update(lambda s: setattr(s, "disconnected", s.disconnected + 1))
                return JSONResponse({}, status_code=499)
            if mode == "flaky" and app.state.down:
                return JSONResponse({"error": "judge warming up"}, status_code=503)
            if mode == "faulty" and _answer(body["messages"][-1]["content"]).startswith("fail"):
                return JSONResponse({"error": "judge crashed on this one"}, status_code=500)
            log.update(lambda s: setattr(s, "answered", s.answered + 1))
            return _completion(body)
        finally:
            log.update(lambda s: setattr(s, "ended", s.ended + 1) or setattr(s, "in_flight", s.in_flight - 1))

    return app

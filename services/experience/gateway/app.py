"""The gateway's HTTP edge: an OpenAI-compatible FastAPI app over :class:`~services.experience.gateway.core.Gateway`.

Routes: ``POST /v1/chat/completions`` (streaming with ``stream: true``), ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``. Authentication: ``Authorization: Bearer <key>``, where the key is an open session's (the call is
recorded in it) or one of the service's bearer tokens (``auth_tokens_file``/``admin_tokens_file``; not recorded).
Without token files only session keys are checked: other keys call unrecorded, as the gRPC services are open then.
A session key that is unknown or expired, or a wrong token, is 401. Errors use OpenAI's shape
(:func:`~services.experience.gateway.responses.error_body`): bad input 400 naming the field (``param``), an unknown
model 404, the generator not ready 503, a deadline 504, anything else 500 with a generic message.

Streams: the reply is generated whole (the fleet returns whole samples), then sent as chunks; a client that
disconnects cancels the generation (the engine aborts the request).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import InvalidRequest, NotReady, Overloaded, UpstreamTimeout
from services.common.http_limits import BoundedBody
from services.experience.gateway.core import Gateway
from services.experience.gateway.requests import parse_chat, parse_completion
from services.experience.gateway.responses import chat_body, chat_chunks, completion_body, error_body, sse
from services.experience.gateway.sessions import KEY_PREFIX, Session, SessionRegistry, UnknownSession

logger = logging.getLogger(__name__)


class _Refused(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def _error_response(error: BaseException) -> JSONResponse:
    """One place maps errors to HTTP statuses (module docs)."""
    if isinstance(error, _Refused):
        return JSONResponse(error.body, error.status)
    if isinstance(error, InvalidRequest):
        return JSONResponse(error_body(str(error), "invalid_request_error", error.field), 400)
    if isinstance(error, Overloaded):
        return JSONResponse(error_body(str(error), "rate_limit_error"), 429)
    if isinstance(error, NotReady):
        return JSONResponse(error_body(str(error), "service_unavailable"), 503)
    if isinstance(error, UpstreamTimeout):
        return JSONResponse(error_body(str(error), "timeout"), 504)
    logger.exception("gateway call failed", exc_info=error)
    return JSONResponse(error_body("internal error", "server_error"), 500)


def _caller(request: Request, sessions: SessionRegistry, tokens: Sequence[bytes]) -> Session | None:
    """The call's session (a session key), or None (a service token, or any key without token files)."""
    scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else ""
    if key.startswith(KEY_PREFIX):
        try:
            return sessions.get(key)
        except UnknownSession:
            raise _Refused(401, error_body("the session key is unknown or expired", "authentication_error",
                                           code="invalid_api_key")) from None
    if tokens and not any(hmac.compare_digest(key.encode(), token) for token in tokens):
        raise _Refused(401, error_body("a valid bearer token is required", "authentication_error",
                                       code="invalid_api_key"))
    return None


async def _body_of(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest("body", f"not JSON: {error}") from error


def _check_model(model: str, session: Session | None, served: str) -> None:
    """Outside a session the model must be the one served (a session's calls belong to its run whatever they say)."""
    if session is None and model != served:
        raise _Refused(404, error_body(f"model {model!r} is not served here; {served!r} is",
                                       "invalid_request_error", "model", "model_not_found"))


def _key_check(sessions: SessionRegistry, tokens: Sequence[bytes]) -> Callable[[Any], bool]:
    """Whether a request's ``Authorization`` is an open session's key or one of the service's tokens (any key
    without token files), decided from its headers alone (before its body is read)."""

    def authorized(headers: Any) -> bool:
        scheme, _, key = (headers.get("authorization") or "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        if key.startswith(KEY_PREFIX):
            try:
                sessions.get(key)
                return True
            except UnknownSession:
                return False
        return not tokens or any(hmac.compare_digest(key.encode(), token) for token in tokens)

    return authorized


def _refused_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape for a request refused before it was read (401, 413)."""
    if status == 401:
        return error_body(message, "authentication_error", code="invalid_api_key")
    return error_body(message, "invalid_request_error", "body")


def create_app(gateway: Gateway, sessions: SessionRegistry, tokens: Sequence[bytes],
               max_body_bytes: int = 16 * 1024 * 1024) -> FastAPI:
    """The app (module docs); ``tokens``: the service's bearer tokens (empty: only session keys are checked). The
    key is checked, and a body over ``max_body_bytes`` refused (413), before the body is read
    (:class:`~services.common.http_limits.BoundedBody`)."""
    app = FastAPI(title="fastexp gateway")
    app.add_middleware(BoundedBody, max_bytes=max_body_bytes, authorized=_key_check(sessions, tokens),
                       error_body=_refused_body)

    def caller(request: Request) -> Session | None:
        return _caller(request, sessions, tokens)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            caller(request)
        except _Refused as error:
            return _error_response(error)
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "owned_by": "fastexp"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            session = caller(request)
            parsed = parse_chat(await _body_of(request))
            _check_model(parsed.generation.model, session, gateway.model_name)
            if parsed.generation.stream:
                return StreamingResponse(_chat_stream(gateway, parsed, session), media_type="text/event-stream")
            answer = await gateway.chat(parsed, session)
            return chat_body(answer, parsed.generation, gateway.decode)
        except Exception as error:
            return _error_response(error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            session = caller(request)
            parsed = parse_completion(await _body_of(request))
            _check_model(parsed.generation.model, session, gateway.model_name)
            if parsed.generation.stream:
                raise InvalidRequest("stream", "streaming is supported on /v1/chat/completions only")
            answer = await gateway.complete(parsed)
            return completion_body(answer, parsed.generation, gateway.decode,
                                   lambda choice: gateway.decode_text(choice.token_ids))
        except Exception as error:
            return _error_response(error)

    return app


async def _chat_stream(gateway: Gateway, parsed, session: Session | None) -> AsyncIterator[bytes]:
    """The chat call as server-sent events; an error after the stream began is one ``error`` event, then the end."""
    try:
        answer = await gateway.chat(parsed, session)
    except Exception as error:
        response = _error_response(error)
        yield sse(json.loads(response.body))
        return
    body = chat_body(answer, parsed.generation, gateway.decode)
    for chunk in chat_chunks(body, parsed.generation, parsed.generation.include_usage):
        yield sse(chunk)
    yield sse("[DONE]")

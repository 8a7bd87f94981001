"""Structured logs with a request id carried across services.

A call's request id comes from the caller's ``x-request-id`` gRPC metadata (the key is
:data:`fastexp.channels.REQUEST_ID_KEY`; bound for the call by the server's observing interceptor,
:mod:`services.common.observing`), or from the experience request itself; outbound calls send it on (the client
interceptor of the services' channels, :class:`fastexp.channels.ClientEdge`, reads :func:`current_request_id`), so
one trainer stream's lines can be followed through experience, generator and scorer. Every log record carries
``request_id`` (``-`` outside a call). ``json`` logs are one object per line (python-json-logger); ``text`` logs
are for a terminal. Tokens and secrets are never logged.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from fastexp.channels import REQUEST_ID_KEY

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("fastexp_request_id", default="-")

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
_JSON_FIELDS = ("asctime", "levelname", "name", "request_id", "message")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


def configure_logging(level: str, fmt: Literal["text", "json"] = "text") -> None:
    """Configure the root logger once per process: ``level`` (``INFO``, ...) and ``fmt``."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(_JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def current_request_id() -> str | None:
    """The request id bound to this call (task), or ``None`` outside one."""
    value = _request_id.get()
    return None if value == "-" else value


def bind_request_id(request_id: str | None) -> None:
    """Bind ``request_id`` to the current context (this task and the tasks and threads it starts)."""
    if request_id:
        _request_id.set(request_id)


def request_id_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The request id (``x-request-id``) of a call's invocation metadata, if any."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None

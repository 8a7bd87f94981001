"""Gateway sessions: a random key per agent episode, the calls it recorded, and its expiry. One owner: the registry.

An agent episode opens a session (:meth:`SessionRegistry.open`) and hands the agent its key; every call presented
with the key is recorded in order (:class:`~services.experience.gateway.recording.CallRecord`). A session ends when
its episode is done (:meth:`SessionRegistry.close`, which returns what it recorded) or when it expires: its key is
then unknown (HTTP 401). Keys are 256-bit random (:func:`secrets.token_urlsafe`) and never logged.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from prometheus_client import Counter

from services.common.errors import InvalidRequest
from services.experience.gateway.recording import CallRecord

KEY_PREFIX = "fxs-"

GATEWAY_CALLS = Counter(
    "fastexp_gateway_calls", "Chat calls through the gateway's sessions, by kind: continued (the row went on "
    "token-exactly), fresh (a session's first call), drift (history re-rendered: a new row)", ["kind"],
)


class UnknownSession(Exception):
    """A key that names no open session (never issued, closed, or expired)."""


@dataclass
class Session:
    """One episode's session: ``model`` (the run it belongs to), when it expires (monotonic seconds), the most
    calls it may make, and its calls so far (appended under ``lock``, one call planned at a time)."""

    key: str
    name: str  # not secret: logs and routing name the session by it
    model: str
    expires_at: float
    max_calls: int | None
    calls: list[CallRecord] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    drifts: int = 0

    def remaining_s(self) -> float:
        return self.expires_at - time.monotonic()

    def check_room(self) -> None:
        """Raises :class:`InvalidRequest` (``max_calls``) once ``max_calls`` calls were made."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            raise InvalidRequest("max_calls", f"this episode's session allows {self.max_calls} calls")


class SessionRegistry:
    """Open sessions by key (module docs)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def open(self, model: str, timeout_s: float, max_calls: int | None = None) -> Session:
        """A new session for ``model`` that expires in ``timeout_s`` seconds."""
        self._expire()
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        session = Session(key, secrets.token_hex(6), model, time.monotonic() + timeout_s, max_calls)
        self._sessions[key] = session
        return session

    def get(self, key: str) -> Session:
        """The open session of ``key``.

        Raises:
            UnknownSession: no such session, or it expired (it is then forgotten).
        """
        session = self._sessions.get(key)
        if session is None:
            raise UnknownSession()
        if session.remaining_s() <= 0:
            del self._sessions[key]
            raise UnknownSession()
        return session

    def close(self, session: Session) -> tuple[CallRecord, ...]:
        """End ``session`` (its key is unknown from now on); returns its calls."""
        self._sessions.pop(session.key, None)
        return tuple(session.calls)

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[key]

"""Who is calling: the caller's identity as handlers see it, set by the auth interceptor, never the token itself.

:class:`services.common.security.AuthInterceptor` runs each call as its :class:`Caller` (:func:`calling_as`), so a
handler reads :func:`current_caller` to decide ownership (a run belongs to the token that created it). A caller
is named by the SHA-256 of its bearer token (``principal``), which identifies the same token across calls and
both token files without keeping or logging the token. With authentication off (no token files: a loopback or
``insecure`` deployment) every call is :data:`ANONYMOUS`: it owns everything it makes and may do everything, as
any caller of such a deployment may (UpdateWeights included).

No gRPC here: cores (the experience service's run registry) take a :class:`Caller` as a plain value.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from dataclasses import dataclass

#: The principal of every call when authentication is off.
ANONYMOUS_PRINCIPAL = "anonymous"
#: Hex digits of a principal's hash shown to people (:attr:`Caller.display`): enough to tell tokens apart.
DISPLAY_HEX_DIGITS = 12


@dataclass(frozen=True)
class Caller:
    """A call's identity: ``principal`` (``"anonymous"``, or ``"sha256:"`` and the 64 hex digits of the SHA-256
    of its bearer token) and whether the token is an admin token (``admin_tokens_file``)."""

    principal: str
    admin: bool = False

    @property
    def display(self) -> str:
        """The principal as reports show it: ``"anonymous"`` or ``"sha256:"`` and its first 12 hex digits."""
        scheme, sep, digest = self.principal.partition(":")
        return f"{scheme}:{digest[:DISPLAY_HEX_DIGITS]}" if sep else self.principal


#: Every call's identity when authentication is off: allowed everything, as calls without tokens are there.
ANONYMOUS = Caller(ANONYMOUS_PRINCIPAL, admin=True)

_CALLER: ContextVar[Caller] = ContextVar("fastexp_caller", default=ANONYMOUS)


def caller_of(token: bytes, *, admin: bool) -> Caller:
    """The identity of a call made with the bearer ``token`` (already checked against the token files)."""
    return Caller(f"sha256:{hashlib.sha256(token).hexdigest()}", admin)


def calling_as(caller: Caller) -> None:
    """Make ``caller`` the identity of the running call (its task's context; gRPC runs each call in a task of its
    own, so the identity ends with the call)."""
    _CALLER.set(caller)


def current_caller() -> Caller:
    """The running call's identity: what the auth interceptor set, else :data:`ANONYMOUS` (authentication off)."""
    return _CALLER.get()

"""fastexp's domain errors: plain exceptions, no gRPC (the services' cores raise them; the SDK raises them too).

Each kind has one gRPC status code (the table in :mod:`fastexp.status`): the services' one server interceptor
turns a raised kind into its code, and the clients' one interceptor (:class:`fastexp.channels.ClientEdge`) turns a
received code back into its kind. A trainer can therefore write ``except fastexp.errors.InvalidRequest``; what it
receives is also a ``grpc.RpcError`` with the call's ``code()``, ``details()`` and ``trailing_metadata()``.
"""

from __future__ import annotations


class FastexpError(Exception):
    """Base of the domain errors (INTERNAL unless a subclass says otherwise)."""


class InvalidRequest(FastexpError):
    """A request field is invalid (INVALID_ARGUMENT). The message names the field: ``"<field>: <why>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotReady(FastexpError):
    """The service, or a service it depends on, cannot serve now: starting, draining, unreachable (UNAVAILABLE)."""


class Overloaded(FastexpError):
    """A limit was hit (queue full, too many streams, too large); the caller may retry later or send less
    (RESOURCE_EXHAUSTED)."""


class FailedPrecondition(FastexpError):
    """The operation cannot run in the service's current state or on its platform: an engine asleep, sleep mode on
    a platform without it, models offloaded (FAILED_PRECONDITION). The message says what must change first."""


class PermissionDenied(FastexpError):
    """The caller's token may not do this to this resource: a run another token owns (PERMISSION_DENIED). The
    message names the field (``"run_id: ..."``); an admin token may."""


class NotFound(FastexpError):
    """The request names a resource that does not exist: a run never created or deleted (NOT_FOUND). The message
    names the field (``"run_id: ..."``)."""


class AlreadyExists(FastexpError):
    """The request would create a resource whose name is taken: a run id in use (ALREADY_EXISTS)."""


class UpstreamTimeout(FastexpError):
    """An outbound call or the request's own deadline ran out (DEADLINE_EXCEEDED)."""


class RewardFailed(FastexpError):
    """A reward source could not score some responses (after its own retries); the message names the source.

    UNAVAILABLE: the reward side is broken for these responses now; nothing about the request was wrong.
    """


class EpisodeFailed(FastexpError):
    """A multi-turn episode failed in its environment (a step raised or ran past its deadline, or the session is
    gone because the environment service restarted); the message names the environment (ABORTED). Only that
    episode is lost."""


class StreamFailed(FastexpError):
    """A stream failed after delivering some prompt groups; it has its ``cause``'s status code. The message and
    ``undelivered`` list the prompt indices that were not delivered (nor dropped by dynamic sampling), which is
    exactly what a retry should send again."""

    def __init__(self, cause: FastexpError, undelivered: list[int]) -> None:
        super().__init__(f"{cause}; undelivered prompt indices: {','.join(map(str, undelivered)) or 'none'}")
        self.cause = cause
        self.undelivered = undelivered

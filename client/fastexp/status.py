"""The one two-way table between fastexp's domain errors and gRPC status codes, and the trailing-metadata keys.

- **Server side** (:mod:`services.common.status`): a raised kind becomes its code (:func:`code_of`).
- **Client side** (:class:`fastexp.channels.ClientEdge`, on the trainer's channels and the services' own): a
  received code becomes its kind again (:func:`received_error`). What a caller catches is an instance of the kind
  (``except fastexp.errors.InvalidRequest``) and of ``grpc.RpcError`` (``grpc.aio.AioRpcError``, a snapshot of
  the call: ``code()``, ``details()``, ``trailing_metadata()``), so ``except grpc.RpcError`` keeps working.
- **A service calling another** (:func:`attributed_error`): the received code becomes a plain kind whose message
  names the peer, which the calling service's own interceptor then reports with the same code.

A code with several kinds (UNAVAILABLE: NotReady and RewardFailed) is received as the kind of its first row; a
code with none (UNAUTHENTICATED, INTERNAL, ...) as :class:`RemoteError`, a plain :class:`FastexpError`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import grpc

from fastexp.errors import (
    AlreadyExists,
    EpisodeFailed,
    FailedPrecondition,
    FastexpError,
    InvalidRequest,
    NotFound,
    NotReady,
    Overloaded,
    PermissionDenied,
    RewardFailed,
    StreamFailed,
    UpstreamTimeout,
)

#: (kind, code): each domain error's status code. Read top down, the first row of a code is the kind a client
#: raises when it receives that code.
STATUS_TABLE: tuple[tuple[type[FastexpError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UpstreamTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (EpisodeFailed, grpc.StatusCode.ABORTED),
    (RewardFailed, grpc.StatusCode.UNAVAILABLE),  # received as NotReady: the reward side cannot serve now
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
)
#: kind -> code (server side).
STATUS_CODES: dict[type[FastexpError], grpc.StatusCode] = dict(STATUS_TABLE)
#: code -> kind (client side); a call the peer cancelled (it went away mid-call) reads as NotReady.
RECEIVED_KINDS: dict[grpc.StatusCode, type[FastexpError]] = {
    grpc.StatusCode.CANCELLED: NotReady, **{code: kind for kind, code in reversed(STATUS_TABLE)},
}

#: Trailing metadata of a failed MakeExperiences stream: the prompt indices not delivered, comma-separated.
UNDELIVERED_KEY = "fastexp-undelivered-prompt-indices"
#: Initial metadata of a resumable stream's open the service took up (its record opened): the open's number (1, 2,
#: ...). The client resumes a stream only once an open was taken up: a first open refused outright is an answer.
STREAM_OPEN_KEY = "fastexp-stream-open"
#: Trailing metadata of a stream a stopping replica handed over (UNAVAILABLE): "true"; resume it elsewhere at once.
DRAINED_KEY = "fastexp-drained"
#: Trailing metadata of an INVALID_ARGUMENT answer caused by prompts: every invalid prompt index, comma-separated.
INVALID_PROMPTS_KEY = "fastexp-invalid-prompt-indices"
#: Trailing metadata of a stream that completed without some multi-turn groups: their prompt indices.
FAILED_KEY = "fastexp-failed-prompt-indices"
#: Request metadata naming the run a call acts on where the request message has no run_id field (UpdateWeights of
#: the experience service): its owner, or an admin token, may make the call.
RUN_ID_KEY = "fastexp-run-id"
#: Prefix of every fastexp trailing-metadata key; those with integer values are a stream's counters
#: (``fastexp-dropped-groups``, ``fastexp-generation-rounds``, ...).
STATS_PREFIX = "fastexp-"


def code_of(error: FastexpError) -> grpc.StatusCode:
    """The status code of a domain error: its class's row, or its nearest base's; a StreamFailed takes its
    cause's; INTERNAL for a kind without a row."""
    if isinstance(error, StreamFailed):
        return code_of(error.cause)
    for kind in type(error).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return grpc.StatusCode.INTERNAL


def encode_indices(indices: Iterable[int]) -> str:
    """Prompt indices as a trailing-metadata value: ``"0,3,7"``."""
    return ",".join(map(str, indices))


def indices_in(metadata: Iterable[tuple[str, Any]] | None, key: str) -> list[int] | None:
    """The prompt indices under ``key`` in trailing ``metadata`` (``[]`` when present but empty); None when
    absent."""
    for name, value in metadata or ():
        if name == key:
            text = value.decode() if isinstance(value, bytes) else value
            return [int(i) for i in text.split(",") if i]
    return None


#: Stream counters about the request itself, the same in every open of a resumed stream (not summed over opens).
PER_REQUEST_COUNTERS = frozenset({"truncated-prompts"})


def trailer_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    """The text under ``key`` in trailing ``metadata``; None when absent."""
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def stream_counters(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, int]:
    """A stream's ``fastexp-*`` integer trailers, prefix removed: ``{"dropped-groups": 0, ...}``."""
    return {
        name.removeprefix(STATS_PREFIX): int(value)
        for name, value in metadata or () if name.startswith(STATS_PREFIX) and isinstance(value, str) and value.isdigit()
    }


class RemoteError(grpc.aio.AioRpcError, FastexpError):
    """A failed call as its client receives it: a snapshot of the call (``code()``, ``details()``,
    ``trailing_metadata()``, ``initial_metadata()``) that is also a domain error. :func:`received_error` returns
    an instance of the received code's kind (``isinstance(error, InvalidRequest)``); a code without a kind is
    this class itself. An InvalidRequest's ``field`` and ``reason`` are read from the details (``"field: why"``).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str | None,
        trailing_metadata: Any = None,
        initial_metadata: Any = None,
        debug_error_string: str | None = None,
    ) -> None:
        # not AioRpcError.__init__: its super().__init__() would reach the kind's constructor next in the MRO
        Exception.__init__(self, details)
        self._code, self._details, self._debug_error_string = code, details, debug_error_string
        self._trailing_metadata, self._initial_metadata = trailing_metadata, initial_metadata
        if isinstance(self, InvalidRequest):
            field, sep, reason = (details or "").partition(": ")
            self.field, self.reason = (field, reason) if sep else ("", details or "")

    @property
    def invalid_prompt_indices(self) -> list[int] | None:
        """Every invalid prompt of a request refused for its prompts (nothing was generated); else None."""
        return indices_in(self._trailing_metadata, INVALID_PROMPTS_KEY)

    @property
    def undelivered_prompt_indices(self) -> list[int] | None:
        """The prompts a failed stream did not deliver (what to send again); None when the service did not say."""
        return indices_in(self._trailing_metadata, UNDELIVERED_KEY)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return received_error, (self._code, self._details, self._trailing_metadata, self._initial_metadata,
                                self._debug_error_string)


@functools.cache
def _received_class(kind: type[FastexpError]) -> type[RemoteError]:
    """``Remote<Kind>``: RemoteError and ``kind`` at once (one class per kind, made on first use)."""
    return type(f"Remote{kind.__name__}", (RemoteError, kind), {"__module__": __name__, "__doc__": kind.__doc__})


def received_error(
    code: grpc.StatusCode,
    details: str | None,
    trailing_metadata: Any = None,
    initial_metadata: Any = None,
    debug_error_string: str | None = None,
) -> RemoteError:
    """The error a client raises for a call that ended with ``code``: an instance of its kind (table above)."""
    kind = RECEIVED_KINDS.get(code)
    cls = RemoteError if kind is None else _received_class(kind)
    return cls(code, details, trailing_metadata, initial_metadata, debug_error_string)


def from_rpc_error(error: grpc.RpcError) -> RemoteError:
    """:func:`received_error` for a failed call's ``grpc.RpcError`` (sync or asyncio; returned as is when it
    already is one)."""
    if isinstance(error, RemoteError):
        return error
    debug = getattr(error, "debug_error_string", None)
    return received_error(error.code(), error.details(), error.trailing_metadata(), error.initial_metadata(),
                          debug() if debug else None)


def attributed_error(source: str, error: grpc.RpcError) -> FastexpError:
    """The plain domain error for a call to ``source`` (``"scorer"``, ``"generator host:port"``) that failed:
    the received code's kind, its message ``"<source>: <CODE>: <details>"`` (an InvalidRequest names ``source``
    as its field). A service raises it so that its own callers get the same code, naming the peer at fault; a
    peer's PERMISSION_DENIED (the service's own token lacks a privilege) becomes a plain FastexpError (INTERNAL),
    as UNAUTHENTICATED does, so that a caller is never told it lacks a permission it has."""
    code, details = error.code(), error.details()
    kind = RECEIVED_KINDS.get(code, FastexpError)
    if kind is PermissionDenied:  # a peer refusing this service's own token: its operator's to fix, not the caller's
        kind = FastexpError
    if issubclass(kind, InvalidRequest):
        return kind(source, details or "rejected")
    return kind(f"{source}: {code.name}: {details}")


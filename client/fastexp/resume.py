"""Resumable streams on the trainer's side: what the client holds of a stream, and when a broken stream is resumed.

A stream with a ``stream_id`` (:class:`fastexp.client.ExperienceClient` gives every stream one) survives the loss
of the experience replica serving it. The client records each batch it hands to the trainer
(:class:`StreamProgress`); when the stream breaks with UNAVAILABLE (the replica was killed or drained, the network
cut, a dependency down) it sends the same request again, with the id and a ``StreamResume`` saying what it holds,
through the same address (the Service routes it to any replica). Only the other groups are generated, so the
trainer's iterator yields every prompt group exactly once. :class:`StreamRetry` is the budget; past it,
:class:`StreamResumesExhausted` names the groups that never arrived.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from fastexp.errors import NotReady, Overloaded
from fastexp.status import DRAINED_KEY, STREAM_OPEN_KEY, UNDELIVERED_KEY, RemoteError, trailer_value
from fastexp.types import Experience
from fastexp.v1 import experience_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamRetry:
    """How often a broken stream is resumed: at most ``max_resumes`` times per stream (0: never; the stream then
    has no ``stream_id`` unless the request sets one), waiting ``wait_initial_s`` before the first, doubling up to
    ``wait_max_s`` (with up to ``wait_jitter_s`` of jitter); a replica that drained is resumed at once.

    Raises:
        ValueError: a negative field.
    """

    max_resumes: int = 8
    wait_initial_s: float = 0.5
    wait_max_s: float = 10.0
    wait_jitter_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_resumes", "wait_initial_s", "wait_max_s", "wait_jitter_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


#: The client's default: up to 8 resumes per stream.
DEFAULT_STREAM_RETRY = StreamRetry()


class StreamResumesExhausted(RemoteError, NotReady):
    """A stream broke more often than :class:`StreamRetry` allows: UNAVAILABLE, a ``grpc.RpcError`` and a
    NotReady like the errors it follows. ``undelivered`` lists the prompt indices whose groups never reached the
    trainer (neither delivered nor reported dropped; also in its trailing metadata, so
    :func:`fastexp.client.undelivered_prompt_indices` reads it); ``cause`` is the last error."""

    def __init__(self, stream_id: str, resumes: int, undelivered: list[int], cause: BaseException) -> None:
        message = (f"stream {stream_id!r} broke {resumes + 1} times (the retry budget allows {resumes} resumes); "
                   f"undelivered prompt indices: {','.join(map(str, undelivered)) or 'none'}; last error: "
                   f"{cause.details() if isinstance(cause, grpc.RpcError) else cause}")
        kept = cause.trailing_metadata() if isinstance(cause, grpc.RpcError) else None
        trailers = (*((k, v) for k, v in kept or () if k != UNDELIVERED_KEY),
                    (UNDELIVERED_KEY, ",".join(map(str, undelivered))))
        super().__init__(grpc.StatusCode.UNAVAILABLE, message, trailers)
        self.stream_id = stream_id
        self.undelivered = undelivered
        self.cause = cause


@dataclass
class StreamProgress:
    """What the trainer holds of one stream: the prompt indices of the groups it received (in whole batches) and of
    those reported dropped, and how many batches arrived. Fed every batch before it is handed to the trainer."""

    num_prompts: int
    delivered: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    batches: int = 0
    opens: int = 0
    acknowledged: bool = False  # an open was taken up by the service (its record opened): breaks are resumed

    def open_answered(self, initial_metadata: object) -> None:
        """Note an open's initial metadata: the service acknowledges a stream it took up (``fastexp-stream-open``)."""
        if trailer_value(initial_metadata, STREAM_OPEN_KEY) is not None:  # type: ignore[arg-type]
            self.acknowledged = True

    def received(self, experience: Experience) -> None:
        """Record a batch (its groups are the trainer's from now on)."""
        self.acknowledged = True
        self.delivered.update(int(i) for i in experience.prompt_index)
        self.dropped.update(int(i) for i in experience.dropped_prompt_indices)
        self.batches += 1

    def resume(self) -> experience_pb2.StreamResume:
        """The ``resume`` field of the next open."""
        return experience_pb2.StreamResume(delivered_prompt_indices=sorted(self.delivered),
                                           dropped_prompt_indices=sorted(self.dropped), next_batch_index=self.batches)

    def undelivered(self) -> list[int]:
        """The prompt indices neither delivered nor reported dropped."""
        return [i for i in range(self.num_prompts) if i not in self.delivered and i not in self.dropped]


def breaks_stream(progress: StreamProgress, error: BaseException) -> bool:
    """Whether ``error`` (ending an open of the stream ``progress`` follows) is one a resume may get past (see
    :func:`resumable`)."""
    if isinstance(error, StreamResumesExhausted) or not progress.acknowledged:  # a first open refused outright
        return False  # is the request's answer (the service not ready, full): as without resuming
    return isinstance(error, NotReady) or (isinstance(error, Overloaded) and progress.opens > 1)


def resumable(stream_id: str, progress: StreamProgress, error: BaseException) -> bool | float:
    """stamina's backoff hook for stream ``stream_id``: resume after UNAVAILABLE (or a peer's cancellation, also
    NotReady), logged as a warning with its cause; at once (0 s) when the replica said it drained; after
    RESOURCE_EXHAUSTED only when a resume got it (the replicas left after a drain may be full for a moment; a
    first open's is the request's own answer); anything else ends the stream."""
    if not stream_id or not breaks_stream(progress, error):
        return False
    drained = isinstance(error, grpc.RpcError) and trailer_value(error.trailing_metadata(), DRAINED_KEY) == "true"
    logger.warning("stream %s broke (%s); resuming it%s", stream_id, error, " at once (drained)" if drained else "")
    return 0.0 if drained else True


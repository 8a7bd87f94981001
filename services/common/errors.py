"""Domain errors raised by fastexp's cores, and the one place that maps them to gRPC status codes.

Cores raise these and never import grpc; :class:`ErrorMappingInterceptor` turns them into statuses. Anything else
becomes INTERNAL with a generic message and an error id that is also logged with the traceback.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class FastexpError(Exception):
    """Base of the domain errors; ``code`` is the gRPC status they map to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(FastexpError):
    """A request field is invalid. The message names the field: ``"<field>: <why>"``."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotReady(FastexpError):
    """The service, or a service it depends on, cannot serve now (starting, draining, unreachable)."""

    code = grpc.StatusCode.UNAVAILABLE


class Overloaded(FastexpError):
    """A limit was hit (queue full, too many streams, too large); the caller may retry later or send less."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UpstreamTimeout(FastexpError):
    """An outbound call or the request's own deadline ran out."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class RewardFailed(FastexpError):
    """A reward source could not score some responses (after its own retries); the message names the source.

    UNAVAILABLE: the reward side is broken for these responses now; nothing about the request was wrong.
    """

    code = grpc.StatusCode.UNAVAILABLE


class StreamFailed(FastexpError):
    """A stream failed after delivering some prompt groups. It carries the cause's status code; the message and
    ``undelivered`` list the prompt indices that were not delivered (nor dropped by dynamic sampling), which is
    exactly what a retry should send again."""

    def __init__(self, cause: FastexpError, undelivered: list[int]) -> None:
        super().__init__(f"{cause}; undelivered prompt indices: {','.join(map(str, undelivered)) or 'none'}")
        self.code = cause.code
        self.cause = cause
        self.undelivered = undelivered


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a client sees for ``error``; non-domain errors are INTERNAL with an error id."""
    if isinstance(error, FastexpError):
        return error.code, str(error)
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error (id {error_id})"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any unary-unary, unary-stream or stream-unary handler to statuses (module docs)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.stream_unary is not None:  # request iterator in, one response out: same wrapping
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the one place errors become statuses
            code, message = status_of(error)
            await context.abort(code, message)

    return wrapped


def _wrap_stream(behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]):
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # aclosing: a cancelled call closes the handler's generator now, running its cleanup (engine aborts)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the one place errors become statuses
            code, message = status_of(error)
            await context.abort(code, message)

    return wrapped

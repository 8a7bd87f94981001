"""The outermost server interceptor: counts and times every call, and binds the caller's request id to its logs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.logs import bind_request_id, request_id_from_metadata
from services.common.metrics import GRPC_HANDLED, GRPC_HANDLING_SECONDS
from services.common.rpc import StreamBehavior, UnaryBehavior, WrappingInterceptor, method_parts, wrap_handler


class ObservingInterceptor(WrappingInterceptor):
    """Counts every call by status code (``fastexp_grpc_server_handled_total``) and times it, and binds the
    caller's ``x-request-id`` to the call's logs. It is the outermost interceptor, so it sees the status the
    error-mapping interceptor chose; a client that cancels is counted as ``CANCELLED``."""

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        service, method = method_parts(details)
        return wrap_handler(
            handler,
            unary=lambda behavior: _observed_unary(behavior, service, method),
            stream=lambda behavior: _observed_stream(behavior, service, method),
        )


def _code_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # grpc.aio keeps the raw integer after abort()
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if error is None:
        return "OK"
    # the call was cancelled (its task), or its response stream closed early (the client went away)
    return "CANCELLED" if isinstance(error, asyncio.CancelledError | GeneratorExit) else "UNKNOWN"


@contextlib.contextmanager
def _observing(service: str, method: str, context: grpc.aio.ServicerContext):
    started = time.perf_counter()
    bind_request_id(request_id_from_metadata(context.invocation_metadata()))
    error = None
    try:
        yield
    except BaseException as caught:
        error = caught
        raise
    finally:
        GRPC_HANDLING_SECONDS.labels(service, method).observe(time.perf_counter() - started)
        GRPC_HANDLED.labels(service, method, _code_name(context, error)).inc()


def _observed_unary(behavior: UnaryBehavior, service: str, method: str) -> UnaryBehavior:
    async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _observing(service, method, context):
            return await behavior(request, context)

    return observed


def _observed_stream(behavior: StreamBehavior, service: str, method: str) -> StreamBehavior:
    async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with _observing(service, method, context):
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

    return observed

"""The one place domain errors become gRPC status codes (:class:`ErrorMappingInterceptor`).

The table itself is the client package's (:mod:`fastexp.status`), so the trainer's SDK and the services' own
clients read a code back as the kind it came from: each :mod:`services.common.errors` kind maps to one code
(:data:`STATUS_CODES`); a :class:`StreamFailed` takes its cause's. Anything else becomes INTERNAL with a generic
message and an error id that is also logged with the traceback, so internals never reach a client.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from fastexp.status import STATUS_CODES, code_of
from services.common.errors import FastexpError
from services.common.rpc import StreamBehavior, UnaryBehavior, WrappingInterceptor, wrap_handler

__all__ = ["STATUS_CODES", "ErrorMappingInterceptor", "code_of", "status_of"]

logger = logging.getLogger(__name__)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, message) a client sees for ``error``; non-domain errors are INTERNAL with an error id."""
    if isinstance(error, FastexpError):
        return code_of(error), str(error)
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error (id {error_id})"


class ErrorMappingInterceptor(WrappingInterceptor):
    """Maps exceptions escaping any handler, of every arity, to statuses (module docs)."""

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return wrap_handler(handler, unary=_mapped_unary, stream=_mapped_stream)


def _mapped_unary(behavior: UnaryBehavior) -> UnaryBehavior:
    async def mapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the one place errors become statuses
            await context.abort(*status_of(error))

    return mapped


def _mapped_stream(behavior: StreamBehavior) -> StreamBehavior:
    async def mapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            responses = behavior(request, context)
            if inspect.isawaitable(responses):  # a handler that writes with context.write() (grpc health's Watch)
                await responses
                return
            # aclosing: a cancelled call closes the handler's generator now, running its cleanup (engine aborts)
            async with contextlib.aclosing(responses) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - this is the one place errors become statuses
            await context.abort(*status_of(error))

    return mapped

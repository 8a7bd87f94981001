"""Rewrapping a gRPC method handler, for the server interceptors (errors, observation, authentication).

A ``grpc.RpcMethodHandler`` has one of four arities; an interceptor that changes what a call does rebuilds the
handler of the same arity around a new behaviour. :func:`wrap_handler` does that once for all of them: calls with
one response (unary-unary, stream-unary) get ``unary(behavior)``, calls with a response stream (unary-stream,
stream-stream) get ``stream(behavior)``; the request side (one message or an iterator) passes through untouched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

#: ``behavior(request_or_iterator, context) -> awaitable response``
UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
#: ``behavior(request_or_iterator, context) -> async iterator of responses``
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[UnaryBehavior], UnaryBehavior],
    stream: Callable[[StreamBehavior], StreamBehavior],
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped by ``unary`` (one response) or ``stream`` (a response stream)."""
    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **codecs)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **codecs)


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that rebuilds each call's handler with :meth:`wrap` (unknown methods pass through)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return handler if handler is None else self.wrap(handler, handler_call_details)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler the call runs instead of ``handler`` (often :func:`wrap_handler` around it)."""
        raise NotImplementedError


def method_parts(handler_call_details: grpc.HandlerCallDetails) -> tuple[str, str]:
    """``("fastexp.v1.ScoringService", "Score")`` of a call."""
    service, _, method = handler_call_details.method.lstrip("/").partition("/")
    return service, method

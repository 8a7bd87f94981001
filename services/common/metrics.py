"""Prometheus metrics of the three services (prometheus-client), and the HTTP endpoint that exposes them.

Every metric lives in the process's default registry and is named ``fastexp_<what>_<unit>`` following Prometheus
conventions (``_total`` on counters, base units: seconds, tokens, nats). A service exposes ``/metrics`` on its
``metrics_port`` setting (off when unset). The series and what to watch are listed in README "Operations".

gRPC server metrics follow the go-grpc-prometheus names (``grpc_service``, ``grpc_method``, ``grpc_code``) so
existing dashboards and alerts apply; :class:`ObservingInterceptor` records them for every method and binds the
caller's request id to the call's logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.common.logs import bind_request_id, request_id_from_metadata

# Latencies from 1 ms to 10 min: a forward micro-batch is ~0.1-10 s, a whole stream minutes.
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

GRPC_HANDLED = Counter(
    "fastexp_grpc_server_handled", "gRPC calls finished, by method and status code",
    ["grpc_service", "grpc_method", "grpc_code"],
)
GRPC_HANDLING_SECONDS = Histogram(
    "fastexp_grpc_server_handling_seconds", "Time from a call's start to its last message or status",
    ["grpc_service", "grpc_method"], buckets=_SECONDS,
)
STAGE_SECONDS = Histogram(
    "fastexp_stage_duration_seconds",
    "Time in one pipeline stage: generate (a prompt group, submit to last sample), score (a group), actor, "
    "reference, critic (a forward over ready groups), advantages (a batch), stream (a batch handed to the trainer)",
    ["stage"], buckets=_SECONDS,
)
GENERATED_TOKENS = Counter("fastexp_generated_tokens", "Response tokens sampled by the generator", ["backend"])
GENERATION_REQUESTS_IN_FLIGHT = Gauge(
    "fastexp_generation_requests_in_flight", "Sequences submitted to the engine and not yet finished"
)
POLICY_VERSION = Gauge("fastexp_policy_version", "Weights version now serving (generator) or held (experience)")
QUEUE_DEPTH = Gauge(
    "fastexp_queue_depth",
    "Prompt groups waiting in the experience pipeline: scored (awaiting a forward), forwarded (awaiting a batch)",
    ["queue"],
)
DEPENDENCY_UP = Gauge(
    "fastexp_dependency_up",
    "1 while a dependency answers the experience service's readiness probes (generator, scorer), else 0",
    ["dependency"],
)
ACTIVE_STREAMS = Gauge("fastexp_active_streams", "MakeExperiences streams being served")
EXPERIENCE_SAMPLES = Counter("fastexp_experience_samples", "Samples (rows) streamed to trainers")
VISION_TOKEN_REPAIRS = Counter(
    "fastexp_vision_token_repairs",
    "Image/video placeholder mismatches repaired: response_placeholder = sampled placeholder tokens replaced by "
    "the pad token; prompt_mismatch = rows whose generator prompt ids differed from the processor's",
    ["kind"],
)
REWARD = Histogram(
    "fastexp_reward", "Scorer reward per sample, before shaping",
    buckets=(-10, -5, -2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10),
)
KL_NATS = Histogram(
    "fastexp_kl_nats", "Mean per-token KL(actor || reference) estimate of a sample, in nats",
    buckets=(0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
REWARD_SOURCE_SECONDS = Histogram(
    "fastexp_reward_source_duration_seconds", "Time a reward source took for one batch of items",
    ["source"], buckets=_SECONDS,
)
REMOTE_REWARD_REQUESTS = Counter(
    "fastexp_remote_reward_requests", "HTTP requests to remote reward endpoints, by outcome (ok, error, timeout)",
    ["endpoint", "outcome"],
)
REMOTE_REWARD_RETRIES = Counter("fastexp_remote_reward_retries", "Retried remote reward requests", ["endpoint"])
REMOTE_REWARD_FAILURES = Counter(
    "fastexp_remote_reward_failures", "Items a remote reward endpoint could not score after its retries",
    ["endpoint"],
)


def start_metrics_server(host: str, port: int) -> int:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the bound port (``port=0`` picks one).

    Raises:
        OSError: the address could not be bound.
    """
    server, _thread = start_http_server(port, addr=host)
    return server.server_port


def stage_timer(stage: str):
    """``with stage_timer("score"):`` observes the block's wall time in ``fastexp_stage_duration_seconds``
    (prometheus-client's own timer, ``time.perf_counter``)."""
    return STAGE_SECONDS.labels(stage).time()


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call by status code and times it, and binds the caller's ``x-request-id`` to the call's logs.
    It is the outermost interceptor, so it sees the status the error-mapping interceptor chose; a client that
    cancels is counted as ``CANCELLED``."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, service, method), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, service, method), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_stream(handler.unary_stream, service, method), **kwargs)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_stream(handler.stream_stream, service, method), **kwargs)
        return handler


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


def _observe(service: str, method: str, started: float, context: grpc.aio.ServicerContext,
             error: BaseException | None) -> None:
    GRPC_HANDLING_SECONDS.labels(service, method).observe(time.perf_counter() - started)
    GRPC_HANDLED.labels(service, method, _code_name(context, error)).inc()


def _unary(behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], service: str, method: str):
    async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started, error = time.perf_counter(), None
        bind_request_id(request_id_from_metadata(context.invocation_metadata()))
        try:
            return await behavior(request, context)
        except BaseException as caught:
            error = caught
            raise
        finally:
            _observe(service, method, started, context, error)

    return observed


def _stream(behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]], service: str, method: str):
    async def observed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started, error = time.perf_counter(), None
        bind_request_id(request_id_from_metadata(context.invocation_metadata()))
        try:
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except BaseException as caught:
            error = caught
            raise
        finally:
            _observe(service, method, started, context, error)

    return observed

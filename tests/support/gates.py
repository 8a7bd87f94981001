"""Gated upstreams: real gRPC servers in front of a real generator or scorer that pass every call through, except
that ``Generate`` or ``Score`` calls can be held (accepted, never answered) while a gate is closed. Tests use them
to make an upstream hang (the deadline path) or to keep streams open in flight, and wait on ``held`` instead of
sleeping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2_grpc

from fastexp.v1 import generation_pb2_grpc, scoring_pb2_grpc


class Gate:
    """Open by default; calls that pass a closed gate wait for it to open. ``held``: calls waiting now;
    :meth:`wait_held` returns once that many wait (an observable condition, not a delay)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Condition()
        self.held = 0
        self.arrived = 0  # calls that reached the gate, open or not
        self._let_through = 0  # calls a closed gate still passes

    def close(self, after: int = 0) -> None:
        """Close: the next ``after`` calls still pass, those after them wait."""
        self._let_through = after
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def passage(self) -> None:
        """Wait while the gate is closed (counted in ``held``)."""
        if not self._open.is_set() and self._let_through > 0:
            self._let_through -= 1
            self.arrived += 1
            return
        async with self._changed:
            self.arrived += 1
            self.held += 1
            self._changed.notify_all()
        try:
            await self._open.wait()
        finally:
            async with self._changed:
                self.held -= 1
                self._changed.notify_all()

    async def wait_held(self, count: int, timeout_s: float = 120.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.held >= count), timeout_s)


class GatedGenerator(generation_pb2_grpc.GenerationServiceServicer):
    """Passes every GenerationService call to ``upstream``; ``Generate`` waits at ``gate`` first."""

    def __init__(self, upstream: generation_pb2_grpc.GenerationServiceStub, gate: Gate) -> None:
        self._upstream, self.gate = upstream, gate

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        await self.gate.passage()
        async for response in self._upstream.Generate(request, timeout=context.time_remaining()):
            yield response

    async def GetModelInfo(self, request, context):  # noqa: N802
        return await self._upstream.GetModelInfo(request, timeout=context.time_remaining())

    async def UpdateWeights(self, request_iterator, context):  # noqa: N802
        return await self._upstream.UpdateWeights(request_iterator, timeout=context.time_remaining())

    async def Sleep(self, request, context):  # noqa: N802
        return await self._upstream.Sleep(request, timeout=context.time_remaining())

    async def WakeUp(self, request, context):  # noqa: N802
        return await self._upstream.WakeUp(request, timeout=context.time_remaining())


class GatedScorer(scoring_pb2_grpc.ScoringServiceServicer):
    """Passes ``Score`` calls to ``upstream`` after waiting at ``gate``."""

    def __init__(self, upstream: scoring_pb2_grpc.ScoringServiceStub, gate: Gate) -> None:
        self._upstream, self.gate = upstream, gate

    async def Score(self, request, context):  # noqa: N802
        await self.gate.passage()
        return await self._upstream.Score(request, timeout=context.time_remaining())


class _Health(health_pb2_grpc.HealthServicer):
    """Health answered by the upstream's own health service."""

    def __init__(self, upstream: health_pb2_grpc.HealthStub) -> None:
        self._upstream = upstream

    async def Check(self, request, context):  # noqa: N802
        return await self._upstream.Check(request, timeout=context.time_remaining())


@contextlib.asynccontextmanager
async def gated(kind: str, upstream_address: str) -> AsyncIterator[tuple[str, Gate]]:
    """A gated proxy (``kind``: ``generator`` or ``scorer``) of the service at ``upstream_address``, on a loopback
    port: its address and gate."""
    channel = grpc.aio.insecure_channel(upstream_address)
    gate = Gate()
    server = grpc.aio.server()
    if kind == "generator":
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GatedGenerator(generation_pb2_grpc.GenerationServiceStub(channel), gate), server)
    else:
        scoring_pb2_grpc.add_ScoringServiceServicer_to_server(
            GatedScorer(scoring_pb2_grpc.ScoringServiceStub(channel), gate), server)
    health_pb2_grpc.add_HealthServicer_to_server(_Health(health_pb2_grpc.HealthStub(channel)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", gate
    finally:
        gate.open()
        await server.stop(0)
        await channel.close()

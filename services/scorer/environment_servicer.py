"""gRPC adapter of the environment host: decode, call :class:`~services.scorer.environments.EnvironmentHost`,
encode. Served by the scorer process next to ``ScoringService``."""

from __future__ import annotations

import grpc

from fastexp.v1 import environment_pb2, environment_pb2_grpc
from services.scorer.environments import EnvironmentHost, EpisodeStart


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """``fastexp.v1.EnvironmentService`` over an :class:`EnvironmentHost`."""

    def __init__(self, host: EnvironmentHost) -> None:
        self._host = host

    async def StartEpisode(  # noqa: N802 - gRPC method name
        self, request: environment_pb2.StartEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.StartEpisodeResponse:
        start = EpisodeStart(request.prompt, request.reference, request.label, request.max_turns, request.tenant)
        session_id, observation = await self._host.start(request.environment, start)
        return environment_pb2.StartEpisodeResponse(
            session_id=session_id, observation=observation, observation_role="user"
        )

    async def Step(  # noqa: N802 - gRPC method name
        self, request: environment_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.StepResponse:
        result = await self._host.step(request.session_id, request.action)
        return environment_pb2.StepResponse(
            observation=result.observation, observation_role=result.role, reward=result.reward, done=result.done,
            metrics={name: float(value) for name, value in result.metrics.items()},
        )

    async def EndEpisode(  # noqa: N802 - gRPC method name
        self, request: environment_pb2.EndEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> environment_pb2.EndEpisodeResponse:
        await self._host.end(request.session_id)
        return environment_pb2.EndEpisodeResponse()

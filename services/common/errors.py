"""Domain errors raised by fastexp's cores: plain exceptions, no gRPC.

They are defined once, in the client package (:mod:`fastexp.errors`), so that the trainer's SDK raises the same
kinds the services raise; the one status table (:mod:`fastexp.status`) maps each kind to its gRPC code, and the
server interceptor (:mod:`services.common.status`) applies it.
"""

from __future__ import annotations

from fastexp.errors import (
    EpisodeFailed,
    FailedPrecondition,
    FastexpError,
    InvalidRequest,
    NotReady,
    Overloaded,
    RewardFailed,
    StreamFailed,
    UpstreamTimeout,
)

__all__ = [
    "EpisodeFailed", "FailedPrecondition", "FastexpError", "InvalidRequest", "NotReady", "Overloaded",
    "RewardFailed", "StreamFailed", "UpstreamTimeout",
]

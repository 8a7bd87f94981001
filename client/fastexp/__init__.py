"""fastexp: RLHF experiences over gRPC.

``pip install fastexp`` gives trainers the client alone (grpcio, protobuf, numpy, torch)::

    from fastexp import ExperienceClient, RequestOptions, Sampling

The experience math is :mod:`fastexp.rl` (torch only). The services, the ``fastexp`` command and the demo are the
``fastexp-server`` distribution. Names are imported on first use, so ``import fastexp`` (or its generated
``fastexp.v1`` contract) costs nothing more.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "ExperienceClient": "fastexp.client",
    "invalid_prompt_indices": "fastexp.client",
    "undelivered_prompt_indices": "fastexp.client",
    "update_generator_weights": "fastexp.client",
    "sleep_generator": "fastexp.client",
    "wake_up_generator": "fastexp.client",
    "RequestOptions": "fastexp.request",
    "StreamRetry": "fastexp.resume",
    "StreamResumesExhausted": "fastexp.resume",
    "AgentOptions": "fastexp.request",
    "Sampling": "fastexp.request",
    "DEFAULT_SAMPLING": "fastexp.request",
    "build_request": "fastexp.request",
    "encode_image": "fastexp.request",
    "VideoSampling": "fastexp.video",
    "video_frames": "fastexp.video",
    "Experience": "fastexp.types",
    "VisionInputs": "fastexp.types",
    "unpack_experience": "fastexp.packing",
    "pack_experience": "fastexp.packing",
    "weight_chunks": "fastexp.weights",
    "save_value_model": "fastexp.critic",
    "ClientTLS": "fastexp.security",
    "Run": "fastexp.runs",
    "RunLimits": "fastexp.runs",
    "LoraSpec": "fastexp.runs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastexp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value

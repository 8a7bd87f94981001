"""Resumable streams at the edge: the ``stream_id`` and ``resume`` fields checked, the request's fingerprint, and a
resumed open's request (the groups the client holds left out). See ``MakeExperiencesRequest.stream_id``."""

from __future__ import annotations

import dataclasses
import hashlib
import re

from fastexp.v1 import experience_pb2
from services.common.errors import InvalidRequest
from services.experience.config import ExperienceRequest, StreamPoint

STREAM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_stream_fields(message: experience_pb2.MakeExperiencesRequest) -> None:
    """Raises InvalidRequest naming ``stream_id`` or ``resume.*`` when they are malformed (before any work)."""
    if message.stream_id and not STREAM_ID.fullmatch(message.stream_id):
        raise InvalidRequest("stream_id", "1..128 characters of A-Z a-z 0-9 . _ -, the first a letter or digit")
    if not message.HasField("resume"):
        return
    if not message.stream_id:
        raise InvalidRequest("resume", "only a stream with a stream_id can be resumed")
    resume, prompts = message.resume, len(message.prompts)
    held = len(resume.delivered_prompt_indices) + len(resume.dropped_prompt_indices)
    if held > prompts:  # checked first: the lists are read only when no longer than the prompts
        raise InvalidRequest("resume", f"holds {held} prompt groups of a request of {prompts} prompts")
    for field in ("delivered_prompt_indices", "dropped_prompt_indices"):
        indices = getattr(resume, field)
        bad = [i for i in indices if i >= prompts]
        if bad:
            raise InvalidRequest(f"resume.{field}", f"{bad[:8]} are not indices of the {prompts} prompts")
        if len(set(indices)) != len(indices):
            raise InvalidRequest(f"resume.{field}", "an index appears twice")
    if resume.next_batch_index > prompts:
        raise InvalidRequest("resume.next_batch_index", f"must be at most the {prompts} prompts (one group a batch "
                             f"at least), got {resume.next_batch_index}")


def request_fingerprint(message: experience_pb2.MakeExperiencesRequest) -> str:
    """``sha256:<hex>`` of the request without ``request_id`` and ``resume`` (what every open of a stream sends
    alike), serialized deterministically."""
    same = experience_pb2.MakeExperiencesRequest()
    same.CopyFrom(message)
    same.ClearField("request_id")
    same.ClearField("resume")
    return "sha256:" + hashlib.sha256(same.SerializeToString(deterministic=True)).hexdigest()


def resumed_request(decoded: ExperienceRequest, resume: experience_pb2.StreamResume,
                    point: StreamPoint) -> ExperienceRequest:
    """``decoded`` without the prompts the client holds (delivered or reported dropped), at ``point``.

    The prompts kept keep their message indices (``prompt_indices``); skipped prompts the client was told about are
    not reported again; with dynamic sampling the delivered groups count towards ``num_groups``.
    """
    held = {*resume.delivered_prompt_indices, *resume.dropped_prompt_indices}
    keep = [i for i in range(len(decoded.prompts)) if decoded.source_index(i) not in held]
    config = decoded.config
    if config.dynamic_sampling is not None:
        wanted = max(0, config.dynamic_sampling.num_groups - len(set(resume.delivered_prompt_indices)))
        config = dataclasses.replace(config, dynamic_sampling=dataclasses.replace(
            config.dynamic_sampling, num_groups=wanted))
    return dataclasses.replace(
        decoded, config=config, stream=point,
        prompts=tuple(decoded.prompts[i] for i in keep),
        prompt_indices=tuple(decoded.source_index(i) for i in keep),
        skipped_prompt_indices=tuple(i for i in decoded.skipped_prompt_indices if i not in held),
    )

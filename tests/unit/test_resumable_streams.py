"""Resumable streams' pure parts (issue 43): a resumed open's request, the request fingerprint, the statistics'
counted rows, the stream records in memory, and the client's record of what it holds and when it resumes."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from fastexp.client import undelivered_prompt_indices
from fastexp.errors import FailedPrecondition, InvalidRequest, NotReady
from fastexp.request import RequestOptions, build_request
from fastexp.resume import StreamProgress, StreamResumesExhausted, StreamRetry, resumable
from fastexp.rl.advantages import get_estimator
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.options import RewardOptions
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.status import DRAINED_KEY, received_error
from fastexp.types import ForwardOutputs
from fastexp.v1 import experience_pb2
from services.experience.api.request import decode_request
from services.experience.api.streams import check_stream_fields, request_fingerprint, resumed_request
from services.experience.config import DynamicSamplingOptions, ExperienceConfig, StreamPoint
from services.experience.pipeline.streams import GroupsCounted, MemoryStreams, StreamKey
from tests.unit.test_math import _rollout
from tests.unit.test_request_validation import LIMITS, MAX_MODEL_LEN, tokenizer  # noqa: F401 - fixture

PROMPTS = [f"What is {i} + 1?" for i in range(5)]


def _message(**options) -> experience_pb2.MakeExperiencesRequest:
    message = build_request(PROMPTS, RequestOptions(n_samples_per_prompt=2, **options))
    message.stream_id = "s-1"
    return message


def test_a_resumed_open_samples_only_what_the_client_lacks_under_the_messages_indices(tokenizer):  # noqa: F811
    message = _message()
    decoded = decode_request(message, tokenizer, LIMITS, MAX_MODEL_LEN)
    resume = experience_pb2.StreamResume(delivered_prompt_indices=[0, 3], dropped_prompt_indices=[1],
                                         next_batch_index=2)
    point = StreamPoint("s-1", "anonymous", start_version=4, first_batch_index=2)
    resumed = resumed_request(decoded, resume, point)
    assert [resumed.source_index(i) for i in range(len(resumed.prompts))] == [2, 4]
    assert [p.text for p in resumed.prompts] == [decoded.prompts[2].text, decoded.prompts[4].text]
    assert resumed.stream == point and resumed.skipped_prompt_indices == ()
    # dynamic sampling: the delivered groups count towards num_groups
    dynamic = dataclasses.replace(decoded, config=dataclasses.replace(
        decoded.config, dynamic_sampling=DynamicSamplingOptions(num_groups=3)))
    assert resumed_request(dynamic, resume, point).config.dynamic_sampling.num_groups == 1


def test_the_fingerprint_is_the_request_without_its_id_and_resume():
    first, again, other = _message(request_id="a"), _message(request_id="b"), _message(kl_coef=0.5)
    again.resume.delivered_prompt_indices.append(1)
    assert request_fingerprint(first) == request_fingerprint(again) != request_fingerprint(other)


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: setattr(m, "stream_id", "a b"), "stream_id"),
    (lambda m: setattr(m, "stream_id", "x" * 129), "stream_id"),
    (lambda m: m.resume.dropped_prompt_indices.append(5), "resume.dropped_prompt_indices"),
    (lambda m: (m.ClearField("stream_id"), m.resume.SetInParent()), "resume"),
    (lambda m: m.resume.delivered_prompt_indices.extend([0, 0]), "resume.delivered_prompt_indices"),
    (lambda m: m.resume.delivered_prompt_indices.extend(range(6)), "resume"),
    (lambda m: setattr(m.resume, "next_batch_index", 6), "resume.next_batch_index"),
])
def test_stream_fields_are_named_when_wrong(change, field):
    message = _message()
    change(message)
    with pytest.raises(InvalidRequest) as raised:
        check_stream_fields(message)
    assert raised.value.field == field


def test_rows_of_groups_counted_before_leave_the_moments_and_beta_unchanged():
    # four rows, two groups of two; the second group was counted by an open that broke
    mask = torch.ones(4, 3, dtype=torch.bool)
    rollout = _rollout(mask)._replace(prompt_index=(0, 0, 1, 1), sample_index=(0, 1, 0, 1))
    config = ExperienceConfig(2, get_estimator("reinforce"), reward=RewardOptions(reward_running_norm=True))
    reward = torch.tensor([1.0, 2.0, 30.0, 40.0])
    state = RunState(RunningMoments(), KLController(0.1))
    forward = ForwardOutputs(torch.zeros(4, 3), torch.zeros(4, 3), None)
    counted = GroupsCounted(StreamKey("anonymous", "s-1"), (7, 7, 9, 9))
    _, after = estimate_experience(rollout, reward, {}, forward, config, state, counted=counted.mask(frozenset({9})))
    assert after.reward_moments == RunningMoments().update(torch.tensor([1.0, 2.0]))
    _, everything = estimate_experience(rollout, reward, {}, forward, config, state)
    assert everything.reward_moments.count == 4


async def test_memory_records_refuse_another_request_and_remember_what_was_counted():
    streams, key = MemoryStreams(), StreamKey("anonymous", "s-1")
    first = await streams.open(key, "sha256:a", start_version=3, delivered=(), resume=False)
    assert (first.start_version, first.opens) == (3, 1)
    streams.count(GroupsCounted(key, (0, 0, 2, 2)))
    again = await streams.open(key, "sha256:a", start_version=9, delivered=[1], resume=True)
    assert (again.start_version, again.opens, again.counted) == (3, 2, frozenset({0, 1, 2}))
    with pytest.raises(InvalidRequest, match="stream_id"):  # another request under the id
        await streams.open(key, "sha256:b", start_version=9, delivered=(), resume=True)
    with pytest.raises(InvalidRequest, match="exists"):  # a first open of an id in use
        await streams.open(key, "sha256:a", start_version=9, delivered=(), resume=False)
    # the first open, superseded by the second, ends at its next batch's statistics
    with pytest.raises(FailedPrecondition, match="resumed"):
        streams.counted(key, open_number=1)
    assert streams.counted(key, open_number=2) == frozenset({0, 1, 2})
    other_token = await streams.open(StreamKey("sha256:bob", "s-1"), "sha256:b", start_version=9, delivered=(),
                                     resume=False)
    assert other_token.opens == 1  # another token's stream of the same id is another stream


def test_the_client_resumes_with_what_it_holds_and_only_after_unavailable():
    progress = StreamProgress(num_prompts=4)
    unavailable = received_error(grpc.StatusCode.UNAVAILABLE, "replica gone")
    assert resumable("s-1", progress, unavailable) is False  # a first open refused outright: not taken up
    progress.open_answered((("fastexp-stream-open", "1"),))
    assert progress.acknowledged
    batch = type("Batch", (), {"prompt_index": (2, 2), "dropped_prompt_indices": (0,)})()
    progress.received(batch)
    resume = progress.resume()
    assert (list(resume.delivered_prompt_indices), list(resume.dropped_prompt_indices), resume.next_batch_index) == (
        [2], [0], 1)
    assert progress.undelivered() == [1, 3]
    drained = received_error(grpc.StatusCode.UNAVAILABLE, "stopping", ((DRAINED_KEY, "true"),))
    invalid = received_error(grpc.StatusCode.INVALID_ARGUMENT, "stream_id: another request")
    assert resumable("s-1", progress, unavailable) is True and resumable("s-1", progress, drained) == 0.0
    assert resumable("s-1", progress, invalid) is False and resumable("", progress, unavailable) is False
    exhausted = StreamResumesExhausted("s-1", 8, [1, 3], unavailable)
    assert isinstance(exhausted, NotReady) and isinstance(exhausted, grpc.RpcError)
    assert exhausted.code() == grpc.StatusCode.UNAVAILABLE and "replica gone" in exhausted.details()
    assert undelivered_prompt_indices(exhausted) == [1, 3] and exhausted.undelivered == [1, 3]
    assert resumable("s-1", progress, exhausted) is False
    # RESOURCE_EXHAUSTED: a first open's answer stands; a resume's (the replicas left are full) is retried
    full = received_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_concurrent_streams: 64 streams")
    progress.opens = 1
    assert resumable("s-1", progress, full) is False
    progress.opens = 2
    assert resumable("s-1", progress, full) is True
    with pytest.raises(ValueError, match="max_resumes"):
        StreamRetry(max_resumes=-1)

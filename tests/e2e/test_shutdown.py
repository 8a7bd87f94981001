"""Graceful shutdown with real processes: SIGTERM to the experience service while a stream runs. New calls are
refused at once, the stream in flight finishes with every group, and the process exits 0 within its grace period."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from fastexp import ExperienceClient, Sampling
from fastexp.errors import NotReady
from services.launcher import LocalCluster, health_status

pytestmark = [pytest.mark.smollm2]


def test_sigterm_lets_the_stream_in_flight_finish_and_refuses_new_ones(smollm2_path, tmp_path):
    overrides = {
        "generator": {"model": smollm2_path, "backend": "hf", "hf_max_batch_size": 2},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "torch_threads": 1,
                       "grace_period_s": 60},
    }
    prompts = [f"Count from {i} to {i + 30}." for i in range(4)]
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        experience = cluster.processes["experience"]
        delivered: list[int] = []
        with ExperienceClient(cluster.address("experience"), timeout_s=300) as client:
            for batch in client.make_experiences(prompts, n_samples_per_prompt=2, micro_rollout_batch_size=2,
                                                 sampling=Sampling(max_new_tokens=24, min_new_tokens=24)):
                if not delivered:
                    in_flight_at_signal = len(batch.prompt_index)  # the first batch of four
                    experience.send_signal(signal.SIGTERM)
                    _wait_not_serving(cluster.address("experience"))
                    with ExperienceClient(cluster.address("experience"), timeout_s=10) as late:
                        with pytest.raises(grpc.RpcError) as refused:
                            list(late.make_experiences(["too late"], n_samples_per_prompt=2))
                    # UNAVAILABLE; or CANCELLED when the call's stream raced the server's shutdown (opened on the
                    # connection before the server's GOAWAY reached the client: gRPC cancels it). The SDK reads both
                    # as NotReady (fastexp.status.RECEIVED_KINDS): retry elsewhere.
                    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                    assert isinstance(refused.value, NotReady)
                delivered.extend(batch.prompt_index)
        assert 0 < in_flight_at_signal < 8  # the stream was mid-flight when SIGTERM came
        assert sorted(delivered) == sorted(i for i in range(4) for _ in range(2))  # every group, once
        assert experience.wait(timeout=60) == 0  # within its grace period


def _wait_not_serving(address: str, timeout_s: float = 30.0) -> None:
    """Block until the service stops reporting SERVING (health NOT_SERVING, or no longer answering), polling its
    health: the condition SIGTERM sets, not a delay."""
    deadline = time.monotonic() + timeout_s
    while (status := health_status(address)) == "SERVING":
        assert time.monotonic() < deadline, f"{address} still {status} {timeout_s} s after SIGTERM"
        time.sleep(0.05)

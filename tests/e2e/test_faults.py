"""Faults with real processes on loopback: the generator is SIGKILLed mid-stream. For a trainer that turned
resuming off (``StreamRetry(max_resumes=0)``; the chaos suite covers resumed streams), the stream ends with
UNAVAILABLE listing the prompt indices not delivered; after a restart, a retry of exactly those delivers them, and
nothing already streamed is repeated."""

from __future__ import annotations

import grpc
import pytest

from fastexp import ExperienceClient, Sampling, StreamRetry, undelivered_prompt_indices
from services.launcher import LocalCluster

pytestmark = [pytest.mark.smollm2]

PROMPTS = [f"Count from {i} to {i + 40}, one number per line." for i in range(6)]


def test_generator_killed_mid_stream_lists_undelivered_prompts_and_a_retry_completes_them(smollm2_path, tmp_path):
    overrides = {
        # two sequences per HF generate call = one prompt group at a time, so groups finish one after another
        "generator": {"model": smollm2_path, "backend": "hf", "hf_max_batch_size": 2},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "torch_threads": 1},
    }
    options = {"n_samples_per_prompt": 2, "micro_rollout_batch_size": 2,
               "sampling": Sampling(max_new_tokens=32, min_new_tokens=32)}
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        delivered: list[int] = []
        delivered_at_kill = None
        with ExperienceClient(cluster.address("experience"), timeout_s=600,
                              stream_retry=StreamRetry(max_resumes=0)) as client:
            with pytest.raises(grpc.RpcError) as raised:
                for experience in client.make_experiences(PROMPTS, **options):
                    delivered.extend(experience.prompt_index)
                    if delivered_at_kill is None:
                        cluster.processes["generator"].kill()  # SIGKILL after the first batch: no drain
                        delivered_at_kill = len(set(delivered))
        assert delivered_at_kill is not None and 0 < delivered_at_kill < len(PROMPTS)  # killed mid-flight
        error = raised.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        undelivered = undelivered_prompt_indices(error)
        assert undelivered and "undelivered prompt indices" in error.details()  # some prompts were still to come
        first = sorted(set(delivered))
        assert first and sorted(first + undelivered) == list(range(len(PROMPTS)))  # each prompt in one list

        cluster.restart("generator")
        retried = _retry(cluster, [PROMPTS[i] for i in undelivered], options)
        assert sorted(set(retried)) == list(range(len(undelivered)))  # each undelivered prompt now delivered once
        assert len(retried) == 2 * len(undelivered)


def _retry(cluster: LocalCluster, prompts: list[str], options: dict) -> list[int]:
    """The trainer's retry, once the experience service reports SERVING again (it has reconnected to the new
    generator): health is the condition waited on, not a delay."""
    cluster.wait_serving(["experience"], timeout_s=60)
    got: list[int] = []
    with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
        for experience in client.make_experiences(prompts, **options):
            got.extend(experience.prompt_index)
    return got


def test_scorer_killed_and_restarted_three_times_every_group_arrives_exactly_once(smollm2_path, tmp_path):
    """A long stream while the scorer process is SIGKILLed and replaced three times (an operator swapping reward
    containers, or crashes): Score calls wait and retry, so every prompt group arrives once and none is lost."""
    import threading

    overrides = {
        "generator": {"model": smollm2_path, "backend": "hf", "hf_max_batch_size": 2},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "torch_threads": 1},
    }
    prompts = [f"Count from {i} to {i + 60}." for i in range(12)]
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        received: list[tuple[int, int]] = []
        errors: list[BaseException] = []
        arrivals = threading.Semaphore(0)

        def consume() -> None:
            try:
                with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
                    for experience in client.make_experiences(
                        prompts, n_samples_per_prompt=2, micro_rollout_batch_size=2,
                        sampling=Sampling(max_new_tokens=40, min_new_tokens=40),
                    ):
                        received.extend(zip(experience.prompt_index, experience.sample_index, strict=True))
                        arrivals.release()
            except BaseException as error:  # surfaced below
                errors.append(error)

        stream = threading.Thread(target=consume)
        stream.start()
        pids = {cluster.processes["scorer"].pid}
        for _ in range(3):
            assert arrivals.acquire(timeout=300), "a batch arrives between the restarts"
            cluster.restart("scorer", kill=True)
            pids.add(cluster.processes["scorer"].pid)
        stream.join(timeout=600)
        assert not stream.is_alive() and errors == []
        assert len(pids) == 4
        assert sorted(received) == [(p, s) for p in range(12) for s in range(2)]

"""Services that wait for each other, on real processes: the experience service started long before its generator
reports NOT_SERVING (MakeExperiences: UNAVAILABLE naming the generator) and serves within seconds of the generator
turning SERVING; a generator restarted while the experience service is idle is picked up again without
restarting the experience service, and a stream opened the moment it is back waits for that rather than being
refused. (Before, the experience service exited after 60 s without a generator.)"""

from __future__ import annotations

import time

import grpc
import pytest

from fastexp import ExperienceClient, Sampling
from services.launcher import LocalCluster, health_status

pytestmark = [pytest.mark.smollm2]

GENERATOR_DELAY_S = 90.0  # longer than the 60 s start-up deadline the experience service used to die at
SERVE_WITHIN_S = 15.0
PROMPTS = ["Say hello.", "Name a colour."]


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32"},
        "experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                       "torch_threads": 1},
    }
    running = LocalCluster(services=(), overrides=overrides, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield running
    finally:
        running.stop()


def _request(address: str) -> list[int]:
    with ExperienceClient(address, timeout_s=120) as client:
        return [i for e in client.make_experiences(
            PROMPTS, n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=8)) for i in e.prompt_index]


def _wait_status(address: str, status: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := health_status(address)) != status:
        assert time.monotonic() < deadline, f"{address}: {seen}, not {status} after {timeout_s} s"
        time.sleep(0.2)


def _unavailable_naming_generator(cluster: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _request(cluster.address("experience"))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the generator at {cluster.address('generator')}" in raised.value.details()


def test_experience_started_first_serves_within_seconds_of_a_generator_that_comes_90_s_later(cluster):
    experience = cluster.address("experience")
    cluster.start_service("scorer")
    started = time.monotonic()
    cluster.start_service("experience", wait=False)
    _wait_status(experience, "NOT_SERVING", timeout_s=120)  # bound and answering health, not ready
    assert health_status(experience, service="liveness") == "SERVING"  # what liveness probes check: no restart
    _unavailable_naming_generator(cluster)

    time.sleep(max(0.0, started + GENERATOR_DELAY_S - time.monotonic()))
    assert cluster.processes["experience"].poll() is None, "the experience service must not give up"
    assert health_status(experience) == "NOT_SERVING"
    cluster.start_service("generator")  # returns once the generator reports SERVING
    _wait_status(experience, "SERVING", timeout_s=SERVE_WITHIN_S)
    assert sorted(_request(experience)) == [0, 0, 1, 1]


def test_a_generator_restarted_while_idle_is_picked_up_without_restarting_the_experience_service(cluster):
    experience = cluster.address("experience")
    if cluster.processes.get("generator") is None or cluster.processes["generator"].poll() is not None:
        cluster.start_service("generator")
    cluster.wait_serving(["experience"], timeout_s=60)
    experience_pid = cluster.processes["experience"].pid

    cluster.kill("generator")
    _wait_status(experience, "NOT_SERVING", timeout_s=30)  # health follows the generator
    _unavailable_naming_generator(cluster)
    cluster.start_service("generator")  # returns once the generator is SERVING: the experience service may lag
    # a stream opened at once waits for the experience service to see the generator again (its ready_wait_s,
    # 10 s, covers the fleet's probe backoff of at most 6 s): served, not refused
    assert sorted(_request(experience)) == [0, 0, 1, 1]
    assert health_status(experience) == "SERVING"
    assert cluster.processes["experience"].pid == experience_pid and cluster.processes["experience"].poll() is None


def test_the_launcher_gives_up_once_naming_the_service_not_ready_with_its_log_tail(tiny_model_path, tmp_path):
    """One overall timeout; the error names the experience service, its health, and what its log says it waits
    for (here: a generator that never comes)."""
    from services.launcher import ServicesNotReady

    overrides = {"experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path,
                                "dtype": "float32", "torch_threads": 1}}
    cluster = LocalCluster(services=("scorer", "experience"), overrides=overrides, log_dir=tmp_path / "logs",
                           start_timeout_s=20)
    with pytest.raises(ServicesNotReady) as raised:
        cluster.start()
    message = str(raised.value)
    assert f"experience at {cluster.address('experience')} (NOT_SERVING)" in message
    assert "scorer" not in message.split("---")[0]  # the scorer was SERVING: only the one not ready is named
    assert f"last lines of {tmp_path / 'logs' / 'experience.log'}" in message
    assert f"for the generator at {cluster.address('generator')}" in message  # the log tail says why
    assert not cluster.processes  # stopped on the way out

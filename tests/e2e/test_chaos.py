"""The chaos suite (issue 43): faults in the middle of a trainer's stream, on real processes. Two generator replicas
(HF backend, the tiny Llama), a scorer behind a gate, two experience replicas on a real PostgreSQL this module
starts and stops, and one address in front of the experience replicas (a real TCP proxy, as a Service: each
connection to the first replica that accepts it). The trainer is the real client, resuming by itself.

Each test lets the trainer take its first batch while the scorer holds the serving replica's next group (the
stream is in the middle of its work, an event, not a delay), makes its fault, opens the gate and reads on. Every
prompt group must arrive exactly once, each row forwarded at the policy version it carries (the base weights' log-
probs), and batch indices run on. Each test reports the fault, the seconds from the fault to the trainer's next row,
and what the resumed opens generated again (the replicas' ``fastexp_groups_regenerated``).

Faults: an experience replica SIGKILLed; drained (SIGTERM: it hands its stream over); the network cut between the
trainer and the replica; the experience replica and a generator replica SIGKILLed together; PostgreSQL stopped
mid-stream (UNAVAILABLE naming the store, then recovery once it is back); three faults in one stream.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch

from fastexp import ExperienceClient, Sampling
from fastexp.resume import StreamRetry
from services.launcher import LocalCluster, log_tail
from tests.e2e.test_experience_replicas import _assert_rows_are, _wait_for
from tests.support.proxies import GateThread, TcpProxy
from tests.support.resumes import groups_regenerated, serving_replica

pytestmark = [pytest.mark.smollm2]

PROMPTS = [f"Count from {i}: {i}, {i + 1}," for i in range(6)]
N = 2
EXPERIENCE = ("experience", "experience-1")
RETRY = StreamRetry(max_resumes=8, wait_initial_s=0.2, wait_max_s=2.0, wait_jitter_s=0.1)


@pytest.fixture(scope="module")
def chaos(tiny_model_path, tmp_path_factory, postgres):
    """The cluster, the scorer's gate and the proxy in front of the experience replicas."""
    root = tmp_path_factory.mktemp("chaos")
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32", "hf_max_batch_size": 4},
        "experience": {
            "actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
            "torch_threads": 1, "upstream_probe_interval_s": 0.5, "upstream_backoff_max_s": 1.0,
            "state_url": postgres.create_database(), "weights_dir": str(root / "weights"), "state_timeout_s": 2.0,
            "state_poll_interval_s": 0.5, "replica_ttl_s": 6.0, "max_groups_ahead": 1,
            "grace_period_s": 4.0, "drain_margin_s": 4.0,  # SIGTERM: open streams are handed over at once
        },
    }
    cluster = LocalCluster(overrides=overrides, log_dir=root / "logs", generator_replicas=2, experience_replicas=2,
                           core_split=None, start_timeout_s=600)
    gate = GateThread("scorer", cluster.address("scorer"))
    overrides["experience"]["scorer_address"] = gate.address
    proxy = TcpProxy([cluster.address(name) for name in EXPERIENCE])
    try:
        with cluster:
            yield cluster, gate, proxy
    finally:
        proxy.close()
        gate.close()


@pytest.fixture
def stage(chaos, postgres):
    """Every process up and SERVING before a test, the gate open after it."""
    cluster, gate, proxy = chaos
    if not postgres.running():
        postgres.start()
    for name in (*cluster.generator_names, *EXPERIENCE):
        if cluster.processes[name].poll() is not None:
            cluster.start_service(name, wait=False)
    cluster.wait_serving([*cluster.generator_names, *EXPERIENCE])
    yield cluster, gate, proxy
    gate.open()


STORE_FAILED = "failed: "  # the state store's log line when a call to it fails ("state store <url>: <what> failed: ")


def _log_count(cluster: LocalCluster, name: str, text: str) -> int:
    return cluster.log_path(name).read_text(errors="replace").count(text)


def _sigterm(cluster: LocalCluster, name: str) -> None:
    """SIGTERM ``name`` and return once it drains (its log says so; with the suite's margin it hands its streams
    over at once)."""
    before = _log_count(cluster, name, "draining:")
    cluster.processes[name].send_signal(signal.SIGTERM)
    _wait_for(lambda: _log_count(cluster, name, "draining:") > before, f"{name} drains")


def _faulted_stream(stage, faults: list[Callable[[str], None]], record) -> list:
    """Stream PROMPTS; before batch k (k = 1, 2, ...) runs ``faults[k-1]`` on the serving replica while the scorer
    holds its next group; returns the batches and reports the fault-to-next-row times."""
    cluster, gate, proxy = stage
    regenerated_before = groups_regenerated(cluster, EXPERIENCE)
    gate.close_after(1)
    batches, recovery = [], []
    with ExperienceClient(proxy.address, timeout_s=300, stream_retry=RETRY) as client:
        stream = client.make_experiences(PROMPTS, n_samples_per_prompt=N, micro_rollout_batch_size=N,
                                         sampling=Sampling(temperature=1.0, max_new_tokens=8), reward_running_norm=True)
        faulted_at = None
        for batch in stream:
            if faulted_at is not None:
                recovery.append(time.monotonic() - faulted_at)
                faulted_at = None
            batches.append(batch)
            if len(batches) <= len(faults):
                gate.wait_held(1)  # the serving replica is in the middle of its next group
                faults[len(batches) - 1](serving_replica(cluster, proxy, EXPERIENCE))
                faulted_at = time.monotonic()
                gate.open()  # (what a killed replica left held passes too)
                if len(batches) < len(faults):
                    gate.close_after(1)  # the resumed open's first group passes, its next is held
        stats = client.last_stream_stats
    assert stats["resumes"] >= len(faults)
    record("seconds_from_fault_to_next_row", [round(s, 2) for s in recovery])
    record("groups_regenerated", groups_regenerated(cluster, EXPERIENCE) - regenerated_before)
    logging.getLogger(__name__).warning("faults %d: next row after %s s, %d groups generated again", len(faults),
                                        [round(s, 2) for s in recovery], groups_regenerated(cluster, EXPERIENCE) - regenerated_before)
    return batches


def _assert_exactly_once(batches, base) -> None:
    """Every prompt's group once, whole; batch indices in order; each row the base weights' at version 0."""
    prompt_index = sorted(int(i) for b in batches for i in b.prompt_index)
    assert prompt_index == sorted(list(range(len(PROMPTS))) * N)
    assert [b.batch_index for b in batches] == list(range(len(batches)))
    _assert_rows_are(base, batches, 0)


@pytest.fixture(scope="module")
def base(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def test_an_experience_replica_sigkilled_mid_stream(stage, base, record_property):
    cluster = stage[0]
    _assert_exactly_once(_faulted_stream(stage, [cluster.kill], record_property), base)


def test_an_experience_replica_drained_mid_stream(stage, base, record_property):
    cluster = stage[0]

    drained: list[str] = []

    def drain(name: str) -> None:
        _sigterm(cluster, name)
        drained.append(name)

    _assert_exactly_once(_faulted_stream(stage, [drain], record_property), base)
    process = cluster.processes[drained[0]]
    # the stop has a limit (grace 4 s + STOP_MARGIN_S 60 s): past it, the replica logs where it was stuck and exits 1
    _wait_for(lambda: process.poll() is not None, "the drained replica exits", timeout_s=120)
    assert process.returncode == 0, log_tail(cluster.log_path(drained[0]), 200)


def test_the_network_cut_between_trainer_and_replica(stage, base, record_property):
    proxy = stage[2]

    def cut(_name: str) -> None:
        assert proxy.cut() >= 1

    _assert_exactly_once(_faulted_stream(stage, [cut], record_property), base)


def test_the_experience_replica_and_a_generator_replica_killed_together(stage, base, record_property):
    cluster = stage[0]

    def kill_both(name: str) -> None:
        cluster.kill(name)
        cluster.kill("generator")

    _assert_exactly_once(_faulted_stream(stage, [kill_both], record_property), base)


def test_postgresql_stopped_mid_stream_then_started(stage, base, postgres, record_property, caplog):
    cluster = stage[0]
    restarted = threading.Event()

    def stop_store(name: str) -> None:
        failures = _log_count(cluster, name, STORE_FAILED)
        postgres.stop()

        def start_when_noticed() -> None:  # once the replica reports the store down, bring it back
            _wait_for(lambda: _log_count(cluster, name, STORE_FAILED) > failures, "the replica finds the store down")
            postgres.start()
            restarted.set()

        threading.Thread(target=start_when_noticed, daemon=True).start()

    with caplog.at_level(logging.WARNING, logger="fastexp.resume"):
        batches = _faulted_stream(stage, [stop_store], record_property)
    assert restarted.is_set()
    # the trainer was told what failed: the store, by its URL
    assert any("state store postgresql://" in r.getMessage() for r in caplog.records), caplog.text
    _assert_exactly_once(batches, base)


def test_three_faults_in_one_stream(stage, base, record_property):
    cluster, _, proxy = stage

    def kill_and_restart(name: str) -> None:
        cluster.kill(name)
        cluster.start_service(name, wait=False)  # back in time for the third fault's resume

    def cut(_name: str) -> None:
        proxy.cut()

    def drain_once_other_is_up(name: str) -> None:
        cluster.wait_serving(list(EXPERIENCE))
        _sigterm(cluster, name)

    _assert_exactly_once(_faulted_stream(stage, [kill_and_restart, cut, drain_once_other_is_up], record_property), base)

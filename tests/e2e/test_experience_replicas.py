"""Two experience replicas on one state store (issue 42), as an operator runs them: real processes (two generator
replicas, HF backend, the tiny Llama; a scorer; two experience services), a real PostgreSQL this module starts and
stops, bearer tokens for two tenants and an admin, the real client. What one replica does, the other serves:

- an update through replica A, then a stream through replica B: B's rows carry the new version and their
  ``action_log_probs`` are the new weights' (an independent forward), and the generators stay at it (B never
  pushes its old weights back);
- a run created through A is the same run through B: owned, refused to another token, not re-creatable;
- both experience replicas killed and started again: the run, its owner, the live version (the actor loads it from
  the weights' blob) and the running statistics continue;
- PostgreSQL stopped: readiness NOT_SERVING and UNAVAILABLE naming the store, nothing answered from memory;
  started again: SERVING and served again.

Events, not sleeps: the tests wait for a replica's log line, a health status, or a response.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa
import torch

from fastexp import ExperienceClient, Sampling
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.launcher import LocalCluster, health_status

pytestmark = [pytest.mark.smollm2]

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789", "admin": "admin-token-0123456789"}
PROMPTS = [f"Count from {i}: {i}, {i + 1}," for i in range(4)]
N = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory, postgres):
    root = tmp_path_factory.mktemp("replicas")
    (root / "call.tokens").write_text(f"{TOKENS['alice']}\n{TOKENS['bob']}\n")
    (root / "admin.tokens").write_text(f"{TOKENS['admin']}\n")
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32", "hf_max_batch_size": 4},
        "experience": {
            "actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
            "torch_threads": 1, "upstream_probe_interval_s": 0.5, "upstream_backoff_max_s": 1.0,
            "state_url": postgres.create_database(), "weights_dir": str(root / "weights"), "state_timeout_s": 3.0,
            "state_poll_interval_s": 0.5, "replica_ttl_s": 6.0, "auth_tokens_file": str(root / "call.tokens"),
            "admin_tokens_file": str(root / "admin.tokens"),
        },
    }
    with LocalCluster(overrides=overrides, log_dir=root / "logs", generator_replicas=2, experience_replicas=2,
                      core_split=None, start_timeout_s=600) as running:
        running.state_url = overrides["experience"]["state_url"]
        yield running


def _client(cluster: LocalCluster, replica: str, who: str) -> ExperienceClient:
    return ExperienceClient(cluster.address(replica), timeout_s=300, token=TOKENS[who])


def _versions(cluster: LocalCluster) -> list[int]:
    versions = []
    for name in cluster.generator_names:
        with grpc.insecure_channel(cluster.address(name)) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            versions.append(stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10).policy_version)
    return versions


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


def _wait_for_log(cluster: LocalCluster, replica: str, line: str, timeout_s: float = 120.0) -> None:
    path: Path = cluster.log_path(replica)
    deadline = time.monotonic() + timeout_s
    while line not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{replica} did not log {line!r} within {timeout_s} s"
        time.sleep(0.2)


def _perturbed(tiny_model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
    return model


def _assert_rows_are(model, batches, version: int) -> None:
    """Every row sampled at ``version`` and forwarded at it, its action_log_probs ``model``'s."""
    for e in batches:
        assert set(e.policy_version) == {version} and e.actor_policy_version == version
        for row in range(len(e.policy_version)):
            mask = e.action_mask[row]
            width = mask.shape[0]
            with torch.inference_mode():
                logits = model(input_ids=e.sequences[row: row + 1],
                               attention_mask=e.attention_mask[row: row + 1]).logits[0, -width - 1: -1]
            expected = torch.log_softmax(logits, -1).gather(-1, e.sequences[row, -width:, None])[:, 0][mask]
            torch.testing.assert_close(e.action_log_probs[row][mask], expected, atol=2e-3, rtol=0)


def _stream(client: ExperienceClient, **options) -> list:
    return list(client.make_experiences(PROMPTS, n_samples_per_prompt=N, micro_rollout_batch_size=N * 2,
                                        sampling=Sampling(temperature=1.0, max_new_tokens=8), **options))


@pytest.fixture(scope="module")
def perturbed(tiny_model_path):
    return _perturbed(tiny_model_path)


def test_an_update_through_one_replica_is_what_another_replica_samples_and_forwards(cluster, perturbed):
    with _client(cluster, "experience", "admin") as a, _client(cluster, "experience-1", "admin") as b:
        a.wait_until_ready(300)
        b.wait_until_ready(300)
        assert a.update_weights(perturbed.state_dict().items()).policy_version == 1
        _wait_for(lambda: _versions(cluster) == [1, 1], "both generators at version 1 (one may have joined late)")
        _assert_rows_are(perturbed, _stream(b), 1)  # B loaded version 1 from its blob before streaming
        _wait_for_log(cluster, "experience-1", "generator fleet follows policy version 1")
        _assert_rows_are(perturbed, _stream(a), 1)
        assert _versions(cluster) == [1, 1]  # B followed the store: it pushed nothing back
        # the next version is issued after the one live, whichever replica the update goes through
        assert b.update_weights(perturbed.state_dict().items()).policy_version == 2


def test_a_run_created_through_one_replica_is_owned_on_every_replica(cluster):
    with _client(cluster, "experience", "alice") as alice_a, _client(cluster, "experience-1", "alice") as alice_b, \
            _client(cluster, "experience-1", "bob") as bob_b:
        created = alice_a.create_run("alice-run")
        assert alice_b.get_run("alice-run").owner == created.owner
        for action in (lambda: bob_b.get_run("alice-run"), lambda: _stream(bob_b, run_id="alice-run")):
            with pytest.raises(grpc.RpcError) as denied:
                action()
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and "run_id" in denied.value.details()
        with pytest.raises(grpc.RpcError) as taken:
            bob_b.create_run("alice-run")
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert len(_stream(alice_b, run_id="alice-run", reward_running_norm=True)) > 0


def _statistics(cluster: LocalCluster, run_id: str) -> int:
    engine = sa.create_engine(cluster.state_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as connection:
            return connection.execute(sa.text("SELECT reward_count FROM runs WHERE run_id = :r"),
                                      {"r": run_id}).scalar_one()
    finally:
        engine.dispose()


def test_both_experience_replicas_restarted_keep_runs_versions_and_statistics(cluster, perturbed):
    counted = _statistics(cluster, "alice-run")
    assert counted == len(PROMPTS) * N
    for replica in cluster.experience_names:
        cluster.restart(replica, kill=True)  # SIGKILL, then a fresh process on the same port
    with _client(cluster, "experience-1", "alice") as alice_b, _client(cluster, "experience", "bob") as bob_a:
        alice_b.wait_until_ready(300)
        run = alice_b.get_run("alice-run")
        assert run.run_id == "alice-run"
        with pytest.raises(grpc.RpcError) as denied:
            bob_a.get_run("alice-run")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        _assert_rows_are(perturbed, _stream(alice_b, run_id="alice-run", reward_running_norm=True), 2)
    assert _statistics(cluster, "alice-run") == counted + len(PROMPTS) * N  # continued, not reset
    _wait_for(lambda: _versions(cluster) == [2, 2], "both generators at version 2")


def test_postgresql_stopped_is_unavailable_naming_it_then_served_again(cluster, postgres):
    with _client(cluster, "experience", "alice") as alice:
        postgres.stop()
        try:
            # readiness follows the store: both replicas leave their Service's endpoints
            for replica in cluster.experience_names:
                _wait_for(lambda replica=replica: health_status(cluster.address(replica)) == "NOT_SERVING",
                          f"{replica} NOT_SERVING while its state store is down")
            for action in (lambda: alice.get_run("alice-run"), lambda: _stream(alice, run_id="alice-run")):
                with pytest.raises(grpc.RpcError) as unavailable:
                    action()
                assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "state store postgresql://" in unavailable.value.details()
        finally:
            postgres.start()
        for replica in cluster.experience_names:
            _wait_for(lambda replica=replica: health_status(cluster.address(replica)) == "SERVING",
                      f"{replica} SERVING once its state store is back")
        assert alice.get_run("alice-run").run_id == "alice-run"
        assert len(_stream(alice, run_id="alice-run")) > 0

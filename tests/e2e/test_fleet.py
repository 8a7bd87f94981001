"""A fleet of three generator replicas (real processes, HF backend, the tiny Llama) behind one experience service:
a replica SIGKILLed mid-stream costs no group and delivers none twice; a policy update reaches every replica; a
replica that was down during an update, or that joins mid-stream, is sent the live weights before it gets work
(and then gets work in that stream); a bad update (wrong shape, corrupted bytes) leaves every replica on the old
version."""

from __future__ import annotations

import time
from collections import Counter

import grpc
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fastexp import ExperienceClient, Sampling
from fastexp.v1 import experience_pb2_grpc, generation_pb2, generation_pb2_grpc
from fastexp.weights import weight_chunks
from services.launcher import LocalCluster, free_port

pytestmark = [pytest.mark.smollm2]

REPLICAS = ("generator", "generator-1", "generator-2")
PROMPTS = [f"Count to {i}." for i in range(24)]
N = 2


@pytest.fixture(scope="module")
def fleet(tiny_model_path, tmp_path_factory):
    """Three replicas configured; ``generator-2`` is left for the tests to start (a replica that joins late)."""
    metrics_port = free_port()
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "hf", "dtype": "float32", "hf_max_batch_size": 2},
        "experience": {
            "actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
            "torch_threads": 1, "metrics_port": metrics_port, "upstream_probe_interval_s": 0.5,
            "upstream_backoff_max_s": 1.0, "generator_down_after_failures": 1, "generator_max_samples_in_flight": 4,
        },
    }
    cluster = LocalCluster(
        services=("generator", "generator-1", "scorer", "experience"), overrides=overrides,
        log_dir=tmp_path_factory.mktemp("logs"), generator_replicas=3, core_split=None,
    )
    cluster.metrics_port = metrics_port
    with cluster:
        yield cluster


def _experience_metric(cluster: LocalCluster, name: str) -> dict[str, float]:
    """``name``'s samples on the experience service's /metrics, by their ``replica`` label."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).text
    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name
    }


def _replica_version(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10).policy_version


def _greedy(address: str, prompt: str = "The capital of France is") -> tuple[int, ...]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            prompts=[generation_pb2.GenerationPrompt(text=prompt)], n_samples_per_prompt=1,
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=12),
        )
        return tuple(next(iter(stub.Generate(request, timeout=60))).completions[0].output_token_ids)


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.25)


def _stream(client: ExperienceClient, prompts=PROMPTS, on_batch=None, max_new_tokens: int = 48) -> list:
    batches = []
    for experience in client.make_experiences(
        prompts, n_samples_per_prompt=N, sampling=Sampling(max_new_tokens=max_new_tokens, temperature=1.0),
        micro_rollout_batch_size=N * 2,
    ):
        batches.append(experience)
        if on_batch is not None:
            on_batch(len(batches))
    return batches


def _perturbed_update(tiny_model_path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Two of the tiny model's tensors plus noise as large as their values (greedy outputs change)."""
    from safetensors.torch import load_file

    weights = load_file(f"{tiny_model_path}/model.safetensors")
    noise = torch.Generator().manual_seed(seed)
    names = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight", "model.norm.weight")
    return [(name, weights[name] + weights[name].std() * torch.randn(weights[name].shape, generator=noise))
            for name in names]


def _live_replicas(cluster: LocalCluster) -> list[str]:
    return [name for name in REPLICAS if name in cluster.processes and cluster.processes[name].poll() is None]


def test_groups_spread_over_the_replicas_and_a_replica_killed_mid_stream_costs_no_group(fleet):
    experience = fleet.address("experience")
    killed = []
    try:
        with ExperienceClient(experience, timeout_s=600) as client:
            client.wait_until_ready(120)
            _wait_for(lambda: sum(_experience_metric(fleet, "fastexp_generator_replica_up").values()) == 2,
                      "both started replicas serving")
            tokens_before = _experience_metric(fleet, "fastexp_generator_replica_tokens_total")

            def kill_a_busy_replica(batches_so_far: int) -> None:
                if killed:
                    return
                in_flight = _experience_metric(fleet, "fastexp_generator_replica_in_flight_samples")
                busy = [name for name in _live_replicas(fleet) if in_flight.get(fleet.address(name), 0) > 0]
                if busy:
                    fleet.kill(busy[0])
                    killed.append(busy[0])

            batches = _stream(client, on_batch=kill_a_busy_replica)
            stats = client.last_stream_stats
        assert killed, "no replica had work in flight after the first batch"
        delivered = Counter(i for e in batches for i in e.prompt_index)
        assert delivered == Counter({i: N for i in range(len(PROMPTS))}), "every group exactly once"
        assert stats["rerouted-groups"] >= 1
        # Both replicas got groups: the killed one had samples in flight when it was killed (it may not have
        # finished one yet, so it may have no tokens to its name), and the survivor sampled tokens.
        survivor = next(name for name in ("generator", "generator-1") if name != killed[0])
        tokens = _experience_metric(fleet, "fastexp_generator_replica_tokens_total")
        assert tokens.get(fleet.address(survivor), 0) > tokens_before.get(fleet.address(survivor), 0), tokens
        rerouted = _experience_metric(fleet, "fastexp_rerouted_groups_total")
        assert rerouted[fleet.address(killed[0])] >= stats["rerouted-groups"]
    finally:
        for name in killed:  # back for the next tests, whatever this one found (at version 0: the live one)
            fleet.start_service(name)


def test_an_update_reaches_every_replica_and_late_or_restarted_ones_get_it_before_work(fleet, tiny_model_path):
    experience = fleet.address("experience")
    before = _greedy(fleet.address("generator"))
    with ExperienceClient(experience, timeout_s=600) as client:
        client.wait_until_ready(120)
        _wait_for(lambda: sum(_experience_metric(fleet, "fastexp_generator_replica_up").values()) == 2,
                  "both started replicas serving (the one killed before is back)")
        fleet.kill("generator-1")  # down during the update
        response = client.update_weights(_perturbed_update(tiny_model_path, seed=1))
        version = response.policy_version
        assert version == 1
        assert _replica_version(fleet.address("generator")) == version
        after = _greedy(fleet.address("generator"))
        assert after != before, "the update changed what the model samples"

        # the replica that missed the update restarts at version 0 and is brought to version 1 before it serves
        fleet.start_service("generator-1")
        _wait_for(lambda: _replica_version(fleet.address("generator-1")) == version, "generator-1 at version 1")
        assert _greedy(fleet.address("generator-1")) == after, "generator-1 serves the live weights"
        _wait_for(lambda: sum(_experience_metric(fleet, "fastexp_generator_replica_up").values()) == 2,
                  "two replicas serving")
        tokens_before = _experience_metric(fleet, "fastexp_generator_replica_tokens_total")

        def start_a_third_replica(batches_so_far: int) -> None:  # one that never ran joins mid-stream
            if batches_so_far == 1:
                fleet.start_service("generator-2", wait=False)  # it loads while the stream goes on

        # long enough (about 30 s on two replicas) for the third to load, be synced and take groups
        batches = _stream(client, prompts=PROMPTS * 4, on_batch=start_a_third_replica, max_new_tokens=160)
        fleet.wait_serving(["generator-2"], timeout_s=120)
    assert {v for e in batches for v in e.policy_version} == {version}, "every row sampled at the live version"
    assert sorted(i for e in batches for i in e.prompt_index) == sorted(list(range(len(PROMPTS) * 4)) * N)
    tokens = _experience_metric(fleet, "fastexp_generator_replica_tokens_total")
    assert all(tokens[fleet.address(n)] > tokens_before.get(fleet.address(n), 0) for n in REPLICAS), tokens
    assert _replica_version(fleet.address("generator-2")) == version
    assert _greedy(fleet.address("generator-2")) == after, "the replica that joined serves the live weights"


def test_a_bad_update_leaves_every_replica_on_the_old_version(fleet, tiny_model_path):
    experience = fleet.address("experience")
    _wait_for(lambda: len(_live_replicas(fleet)) == 3 and
              sum(_experience_metric(fleet, "fastexp_generator_replica_up").values()) == 3, "three replicas serving")
    versions = {name: _replica_version(fleet.address(name)) for name in REPLICAS}
    assert len(set(versions.values())) == 1, versions
    with ExperienceClient(experience, timeout_s=600) as client:
        with pytest.raises(grpc.RpcError) as wrong_shape:
            client.update_weights([("model.norm.weight", torch.ones(3))])
        assert wrong_shape.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model.norm.weight" in wrong_shape.value.details()

        # bytes corrupted in transit: the CRC-32 on the tensor's first chunk no longer matches
        messages = list(weight_chunks(_perturbed_update(tiny_model_path, seed=2), chunk_bytes=1024))
        for message in messages:
            if message.WhichOneof("kind") == "tensor" and message.tensor.name == "model.norm.weight":
                data = bytearray(message.tensor.data)
                data[0] ^= 0xFF
                message.tensor.data = bytes(data)
        with grpc.insecure_channel(experience) as channel, pytest.raises(grpc.RpcError) as corrupted:
            experience_pb2_grpc.ExperienceServiceStub(channel).UpdateWeights(iter(messages), timeout=60)
        assert corrupted.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensors[model.norm.weight]" in corrupted.value.details()
        assert "CRC-32" in corrupted.value.details()
    assert {name: _replica_version(fleet.address(name)) for name in REPLICAS} == versions

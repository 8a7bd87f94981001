"""End to end through the real CLI processes and the real vLLM backend, on a tiny Llama built by the test.

``fastexp serve generator|scorer|experience`` run as subprocesses (the CLI smoke test); the trainer SDK streams.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from fastexp import ExperienceClient, Sampling, build_request, sleep_generator
from fastexp.v1 import experience_pb2_grpc
from services.launcher import LocalCluster, free_port

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    overrides = {
        "generator": {"model": tiny_model_path, "backend": "vllm", "max_model_len": 512,
                      "kv_cache_memory_bytes": 256 * 1024**2, "metrics_port": free_port(),
                      "enable_sleep_mode": True},
        "experience": {"actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                       "metrics_port": free_port()},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


def test_sdk_streams_experiences_from_vllm(cluster):
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(4)]
    with ExperienceClient(cluster.address("experience"), timeout_s=300) as client:
        batches = list(client.make_experiences(
            prompts, references=[str(2 * i) for i in range(4)], n_samples_per_prompt=4, micro_rollout_batch_size=8,
            sampling=Sampling(max_new_tokens=16, seed=3), advantage_estimator="rloo",
        ))
    rows = sorted((p, s) for e in batches for p, s in zip(e.prompt_index, e.sample_index, strict=True))
    assert rows == [(p, s) for p in range(4) for s in range(4)]
    for e in batches:
        mask = e.action_mask
        assert e.sequences.shape[0] in (4, 8) and mask.any(1).all()
        # vLLM (bf16) and the HF actor (fp32) score the same sampled tokens: close, not equal
        assert (e.rollout_log_probs[mask] - e.action_log_probs[mask]).abs().mean() < 0.05
        # rloo advantages of a group sum to zero at the first token when KL is zero (same weights)
        first = e.advantages[:, 0].view(-1, 4)
        assert torch.allclose(first.sum(1), torch.zeros(first.shape[0]), atol=1e-4)


def test_dynamic_sampling_refills_through_the_services_and_reports_drops(cluster):
    # the random tiny model never answers right, so math-verify gives every sample 0: every group is dropped,
    # each round refills the shortfall from the next prompts, and the totals arrive as trailing metadata
    with ExperienceClient(cluster.address("experience"), timeout_s=300) as client:
        batches = list(client.make_experiences(
            ["What is 1 + 1?"] * 6, references=["2"] * 6, n_samples_per_prompt=2,
            sampling=Sampling(max_new_tokens=8, seed=4), dynamic_sampling_num_groups=2,
            dynamic_sampling_max_extra_rounds=1,
        ))
        assert batches == []
        assert client.last_stream_stats == {"dropped-groups": 4, "generation-rounds": 2, "resampled-groups": 0,
                                            "rerouted-groups": 0, "failed-groups": 0, "truncated-prompts": 0,
                                            "skipped-prompts": 0, "resumes": 0}


def test_cancelled_stream_aborts_generation_and_leaves_the_services_healthy(cluster):
    log = cluster.log_dir / "generator.log"
    rss_before = {name: _rss_bytes(cluster, name) for name in ("generator", "experience")}
    with grpc.insecure_channel(cluster.address("experience")) as channel:
        call = experience_pb2_grpc.ExperienceServiceStub(channel).MakeExperiences(
            build_request(["a b c"] * 16, n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=400)),
            timeout=300,
        )
        time.sleep(3.0)  # generation of 32 samples x 400 tokens is under way
        call.cancel()
    deadline = time.monotonic() + 20
    while "aborted" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "aborted" in log.read_text(), "the generator did not abort the cancelled request's samples"
    # the work is freed: no sequence left in the engine, no stream or group held by the experience service
    assert _metric(cluster, "generator", "fastexp_generation_requests_in_flight") == 0
    assert _metric(cluster, "experience", "fastexp_active_streams") == 0
    assert _metric(cluster, "experience", 'fastexp_queue_depth{queue="scored"}') == 0
    assert _metric(cluster, "experience", 'fastexp_queue_depth{queue="forwarded"}') == 0
    for name, before in rss_before.items():  # nothing of the cancelled stream is kept (the engine's KV is
        grown = _rss_bytes(cluster, name) - before  # preallocated; the model was warm before this test)
        assert grown < 150 * 1024**2, (name, grown)
    with ExperienceClient(cluster.address("experience"), timeout_s=120) as client:
        stream = client.make_experiences(["x"] * 3, n_samples_per_prompt=2, advantage_estimator="reinforce",
                                         sampling=Sampling(max_new_tokens=4))
        first = next(stream)
        stream.close()  # stopping the iteration early is a cancel too
        assert first.sequences.shape[0] == 2
        again = list(client.make_experiences(["x"], n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4)))
    assert sum(e.sequences.shape[0] for e in again) == 2


def _rss_bytes(cluster: LocalCluster, service: str) -> int:
    """Resident memory of ``service``'s process (``/proc/<pid>/status`` VmRSS)."""
    status = Path(f"/proc/{cluster.processes[service].pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def _metric(cluster: LocalCluster, service: str, series: str, timeout_s: float = 10.0) -> float:
    """``series`` (name and labels as exposed) on ``service``'s /metrics: polled until it reads 0 or ``timeout_s``
    passes; the last value read."""
    port = cluster.overrides[service]["metrics_port"]
    deadline, value = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
        value = values[0] if values else None
        if value == 0:
            return value
        time.sleep(0.2)
    return value


def test_prompt_over_the_model_limit_is_invalid_argument(cluster):
    with ExperienceClient(cluster.address("experience"), timeout_s=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.make_experiences(["word " * 600], n_samples_per_prompt=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0]" in info.value.details() and "limit is 512" in info.value.details()


def test_scorer_replaced_mid_stream_every_group_arrives_exactly_once(cluster):
    """An operator swaps the scorer container while a stream runs: SIGKILL, then a new process on the port."""
    import threading

    prompts = [f"Add {i} and {i}." for i in range(12)]
    received = []
    errors = []

    def consume():
        try:
            with ExperienceClient(cluster.address("experience"), timeout_s=300) as client:
                for experience in client.make_experiences(
                    prompts, references=[str(2 * i) for i in range(12)], n_samples_per_prompt=2,
                    micro_rollout_batch_size=2, sampling=Sampling(max_new_tokens=300, min_new_tokens=300, seed=6),
                    advantage_estimator="rloo",
                ):
                    received.append((time.monotonic(), experience))
        except Exception as error:  # surfaced below
            errors.append(error)

    old_pid = cluster.processes["scorer"].pid
    stream = threading.Thread(target=consume)
    stream.start()
    time.sleep(1.5)  # generation of 24 x 300 tokens is under way; no group has finished (all run 300 tokens)
    killed_at = time.monotonic()
    cluster.restart("scorer", kill=True)
    stream.join(timeout=300)
    assert not stream.is_alive() and errors == []
    assert cluster.processes["scorer"].pid != old_pid
    assert received and received[0][0] > killed_at  # every group was scored across the swap, none before it
    rows = sorted((p, s) for _, e in received for p, s in zip(e.prompt_index, e.sample_index, strict=True))
    assert rows == [(p, s) for p in range(12) for s in range(2)]


def test_fire_sampling_in_vllm_changes_only_the_first_tokens_temperature(cluster):
    """vLLM applies first_token_temperature through fastexp's logits processor, inside the engine."""
    from fastexp.v1 import generation_pb2_grpc
    from tests.support.fire import HOT, assert_only_the_first_token_is_hot, fire_request

    with grpc.insecure_channel(cluster.address("generator")) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        def completions(request):
            return [c for r in stub.Generate(request, timeout=120) for c in r.completions]

        assert_only_the_first_token_is_hot(
            with_fire=completions(fire_request(HOT)), without_fire=completions(fire_request(None))
        )


def test_weight_update_inside_the_running_vllm_engine(cluster, tiny_model_path):
    """Runs last in this module: it changes the policy. The streamed update reaches vLLM's workers without an
    engine restart; sampled log-probs then follow a forward pass of the new weights, tagged with version 1."""
    from transformers import AutoModelForCausalLM

    from fastexp import update_generator_weights
    from fastexp.tensor_codec import to_numpy
    from fastexp.v1 import generation_pb2, generation_pb2_grpc

    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    updated = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in updated.parameters():
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=g))
    generator = cluster.address("generator")
    assert update_generator_weights(generator, updated.state_dict().items(), chunk_bytes=1 << 16) == 1
    with grpc.insecure_channel(generator) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            prompts=[generation_pb2.GenerationPrompt(text="Count: one, two,")], n_samples_per_prompt=4,
            sampling=generation_pb2.SamplingParams(temperature=1.0, max_new_tokens=12),
        )
        completions = [c for r in stub.Generate(request, timeout=120) for c in r.completions]
        assert stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10).policy_version == 1
    assert len(completions) == 4 and all(c.policy_version == 1 for c in completions)

    def gaps(model, completion):
        prompt, output = list(completion.prompt_token_ids), list(completion.output_token_ids)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]
        return (torch.tensor(to_numpy(completion.output_log_probs)) - expected).abs()

    to_new = torch.cat([gaps(updated, c) for c in completions])
    to_old = torch.cat([gaps(original, c) for c in completions])
    # Per sampled token, the engine's log-prob against an fp32 forward of each weight set. Where the engine runs
    # bf16 (hosts with native bf16), a few tokens whose perturbed logits nearly tie land up to 3 nats off, so
    # the mean of 48 tokens swings 0.08-0.30 with the sample; the median does not (15 requests on a bf16 host,
    # 2026-11-27: median to the new weights 0.04-0.08, to the old 6.5-8.4; 98-100% of tokens nearer the new).
    assert to_new.median() < 0.25 and to_old.median() > 3.0, (to_new, to_old)
    assert (to_new < to_old).float().mean() >= 0.9, (to_new, to_old)


def test_seeded_requests_larger_than_one_prefill_step_leave_the_engine_alive(cluster):
    # 24 prompts x 2 samples of ~300 tokens: more prefill than one scheduler step takes. With chunked prefill,
    # vLLM rewinds a seeded request's CPU generator and the engine dies; the generator turns that off on CPU.
    prompts = ["hello " * 300] * 24
    with ExperienceClient(cluster.address("experience"), timeout_s=300) as client:
        batches = list(client.make_experiences(
            prompts, references=["1"] * 24, n_samples_per_prompt=2, micro_rollout_batch_size=16,
            sampling=Sampling(max_new_tokens=4, seed=8), advantage_estimator="rloo",
        ))
        assert sum(len(e.reward) for e in batches) == 48
        assert min(int(e.total_length.min()) for e in batches) > 250
        assert len(list(client.make_experiences(["What is 1 + 1?"], n_samples_per_prompt=2,
                                                sampling=Sampling(max_new_tokens=4, seed=9)))) == 1


def test_memory_rpcs_answer_failed_precondition_where_the_platform_cannot(cluster):
    """vLLM's CPU build has no sleep mode (even with enable_sleep_mode), and the experience service's models
    already live in host memory: both say so, and both services keep serving."""
    with pytest.raises(grpc.RpcError) as info:
        sleep_generator(cluster.address("generator"), 1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no sleep mode" in info.value.details()
    with ExperienceClient(cluster.address("experience"), timeout_s=120) as client:
        for call, why in ((client.offload_models, "already live in host memory"),
                          (client.reload_models, "not offloaded")):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and why in info.value.details()
        batches = list(client.make_experiences(["still serving?"], n_samples_per_prompt=2,
                                               sampling=Sampling(max_new_tokens=4)))
    assert sum(len(e.prompt_index) for e in batches) == 2

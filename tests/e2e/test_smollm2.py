"""End to end on the embedded default: SmolLM2-135M-Instruct on vLLM, reasoning-gym prompts, math-verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastexp import ExperienceClient, Sampling
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from fastexp.wire import sampling_to_pb
from services.demo.datasets import reasoning_gym_problems
from services.launcher import LocalCluster, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2]


def test_smollm2_experiences_through_vllm(smollm2_path, tmp_path):
    """The demo's path on the launcher's default core split: on a host of two cores or more the engine is lent
    every core while no forward pass waits and gives half back while they run (SetCpuThreads, called by the
    experience service; :mod:`services.experience.fleet.cores`)."""
    problems = reasoning_gym_problems("basic_arithmetic", 4, seed=0)
    metrics_port = free_port()
    overrides = {
        "generator": {"model": smollm2_path, "backend": "vllm", "kv_cache_memory_bytes": 512 * 1024**2},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path, "metrics_port": metrics_port},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
            batches = list(client.make_experiences(
                [list(p.messages) for p in problems], references=[p.reference for p in problems],
                n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=48),
            ))
        stopped, ignored = (_greedy(cluster.address("generator"), ignore_eos) for ignore_eos in (False, True))
        if (os.cpu_count() or 1) > 1:
            _check_the_engine_threads_followed_the_forwards(cluster.address("generator"), metrics_port)
    assert sum(e.sequences.shape[0] for e in batches) == 8
    for e in batches:
        mask = e.action_mask
        assert all(e.response_texts) and all(t.startswith("<|im_start|>system") for t in e.prompt_texts)
        assert set(e.reward.tolist()) <= {0.0, 1.0}
        assert e.kl[mask].abs().max() < 1e-4  # reference == actor weights at policy version 0
        # vLLM and HF, both bf16, agree on the sampled tokens' log-probs up to kernel numerics
        assert (e.rollout_log_probs[mask] - e.action_log_probs[mask]).abs().mean() < 0.1
        for text, length in zip(e.response_texts, e.response_length.tolist(), strict=True):
            if length < 48:  # ended with EOS: kept in the text (skip_special_tokens defaults to False, as in the seed)
                assert text.endswith("<|im_end|>")
    # ignore_eos on vLLM: the same greedy answer, then past its EOS to max_new_tokens
    assert stopped.finish_reason == generation_pb2.FINISH_REASON_STOP and len(stopped.output_token_ids) < 40
    assert ignored.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(ignored.output_token_ids) == 40
    assert list(ignored.output_token_ids[: len(stopped.output_token_ids)]) == list(stopped.output_token_ids)


def _check_the_engine_threads_followed_the_forwards(address: str, metrics_port: int) -> None:
    """The engine was shrunk for the forwards and grown back after them (the growth runs in the background once
    the last pass ends: waited for on the experience service's counter), and SetCpuThreads checks its field."""
    cores = os.cpu_count() or 1
    changes, deadline = {}, time.monotonic() + 60
    while changes.get("all", 0) < 1 and time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        changes = {sample.labels["to"]: sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "fastexp_engine_thread_changes_total"}
        time.sleep(0.2)
    assert changes["shared"] >= 1 and changes["all"] >= 1, changes
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
        assert "cpu-threads" in info.features and info.max_cpu_threads == cores == info.cpu_threads, info
        assert stub.SetCpuThreads(generation_pb2.SetCpuThreadsRequest(threads=1), timeout=30).threads == 1
        assert stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30).cpu_threads == 1
        assert stub.SetCpuThreads(generation_pb2.SetCpuThreadsRequest(threads=0), timeout=30).threads == cores
        with pytest.raises(grpc.RpcError) as refused:
            stub.SetCpuThreads(generation_pb2.SetCpuThreadsRequest(threads=cores + 1), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "threads" in refused.value.details()


def _greedy(address: str, ignore_eos: bool) -> generation_pb2.Completion:
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text=prompt)], n_samples_per_prompt=1,
        sampling=sampling_to_pb(Sampling(temperature=0.0, max_new_tokens=40, ignore_eos=ignore_eos)))
    with grpc.insecure_channel(address) as channel:
        responses = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=300)
        return [c for r in responses for c in r.completions][0]


def test_demo_cli_writes_summary(tmp_path):
    """`fastexp demo` as a user runs it, on SmolLM2 with the HF fallback backend (small and quick)."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--num-prompts", "2", "--n-samples-per-prompt", "2",
         "--max-new-tokens", "8", "--backend", "hf", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("num_experiences", "reward_mean", "accuracy", "kl_mean", "tokens_per_s",
                "time_to_first_experience_s", "groups_with_nonzero_advantage", "rows_with_nonzero_advantage",
                "wall_time_s", "startup_s"):
        assert key in summary
    assert summary["num_experiences"] == 4 and summary["task"] == "basic_arithmetic"
    assert len((out / "experiences.jsonl").read_text().splitlines()) == 4
    assert list(out.glob("batch_*.safetensors"))
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "prompt groups with non-zero advantages" in result.stdout

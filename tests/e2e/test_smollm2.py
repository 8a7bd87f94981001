"""End to end on the embedded default: SmolLM2-135M-Instruct on vLLM, reasoning-gym prompts, math-verify."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from fastexp import ExperienceClient, Sampling
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from fastexp.wire import sampling_to_pb
from services.demo.datasets import reasoning_gym_problems
from services.launcher import LocalCluster

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2]


def test_smollm2_experiences_through_vllm(smollm2_path, tmp_path):
    problems = reasoning_gym_problems("basic_arithmetic", 4, seed=0)
    overrides = {
        "generator": {"model": smollm2_path, "backend": "vllm", "kv_cache_memory_bytes": 512 * 1024**2},
        "experience": {"actor_model": smollm2_path, "reference_model": smollm2_path},
    }
    with LocalCluster(overrides=overrides, log_dir=tmp_path / "logs") as cluster:
        with ExperienceClient(cluster.address("experience"), timeout_s=600) as client:
            batches = list(client.make_experiences(
                [list(p.messages) for p in problems], references=[p.reference for p in problems],
                n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=48),
            ))
        stopped, ignored = (_greedy(cluster.address("generator"), ignore_eos) for ignore_eos in (False, True))
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

"""Per-group pieces into batches and back: split_experience lays each batch out as if it had been built alone."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastexp.rl.advantages import get_estimator
from fastexp.rl.estimate import estimate_experience
from fastexp.rl.options import AdvantageOptions
from fastexp.rl.running import KLController, RunningMoments, RunState
from fastexp.types import ForwardOutputs
from services.common.generation import CompletionRecord
from services.experience.config import ExperienceConfig, PromptSpec
from services.experience.pipeline.assembly import concat_forward, split_experience, split_forward
from services.experience.workers.sequences import build_rollout

settings.register_profile("fastexp", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("fastexp")
PAD = 0


def _completions(seed: int, groups: int, n: int) -> tuple[list[CompletionRecord], list[PromptSpec]]:
    """Groups with prompts of 1-6 tokens and responses of 0-7 tokens, so batches differ in both widths."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for p in range(groups):
        prompt = tuple(int(t) for t in torch.randint(1, 90, (int(torch.randint(1, 7, (1,), generator=g)),),
                                                     generator=g))
        prompts.append(PromptSpec(f"p{p}", prompt, "", ""))
        for s in range(n):
            length = int(torch.randint(0, 8, (1,), generator=g))
            output = tuple(int(t) for t in torch.randint(1, 90, (length,), generator=g))
            completions.append(CompletionRecord(p, s, prompt, output, -np.arange(1, length + 1, dtype=np.float32),
                                                "stop", f"r{p}{s}", policy_version=p))
    return completions, prompts


def _forward(seed: int, rows: int, width: int) -> ForwardOutputs:
    g = torch.Generator().manual_seed(seed + 1)
    return ForwardOutputs(-torch.rand(rows, width, generator=g), -torch.rand(rows, width, generator=g),
                          torch.randn(rows, width, generator=g))


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 5), n=st.integers(1, 3), per_batch=st.integers(1, 3))
def test_split_batches_are_laid_out_as_if_built_alone(seed, groups, n, per_batch):
    completions, prompts = _completions(seed, groups, n)
    rollout = build_rollout(completions, prompts, PAD)
    forward = _forward(seed, len(completions), rollout.action_mask.shape[1])
    config = ExperienceConfig(n, get_estimator("gae"), lambd=0.9, advantage=AdvantageOptions(advantages_norm=True))
    whole, _ = estimate_experience(rollout, torch.arange(len(completions)).float(), {"m": torch.ones(len(completions))},
                                   forward, config, RunState(RunningMoments(), KLController(0.1)), 3, (9,))
    parts = split_experience(whole, per_batch)
    assert [p.batch_index for p in parts] == list(range(3, 3 + len(parts)))
    assert [p.dropped_prompt_indices for p in parts] == [(9,)] + [()] * (len(parts) - 1)
    start = 0
    for part in parts:
        rows = len(part.reward)
        alone = build_rollout(completions[start : start + rows], prompts, PAD)
        for name in ("sequences", "attention_mask", "action_mask", "rollout_log_probs"):
            assert torch.equal(getattr(part, name), getattr(alone, name)), name
        width = part.action_mask.shape[1]
        for name in ("advantages", "returns", "values", "kl", "action_log_probs"):
            original = getattr(whole, name)[start : start + rows]
            assert torch.equal(getattr(part, name), original[:, :width]), name
            assert not original[:, width:].any(), name  # only padding was cut
        assert part.prompt_index == whole.prompt_index[start : start + rows]
        assert torch.equal(part.reward_metrics["m"], whole.reward_metrics["m"][start : start + rows])
        start += rows
    assert start == len(completions)


@given(seed=st.integers(0, 2**16), groups=st.integers(1, 5), n=st.integers(1, 3))
def test_concat_of_split_forward_restores_the_masked_outputs(seed, groups, n):
    completions, prompts = _completions(seed, groups, n)
    rollout = build_rollout(completions, prompts, PAD)
    mask = rollout.action_mask
    forward = ForwardOutputs(*(t * mask for t in _forward(seed, len(completions), mask.shape[1])[:3]))
    widths = [max(1, max(len(c.output_token_ids) for c in completions[g * n : (g + 1) * n])) for g in range(groups)]
    pieces = split_forward(forward, [n] * groups, widths)
    assert [p.action_log_probs.shape[1] for p in pieces] == widths
    back = concat_forward(pieces, mask.shape[1])
    for name in ("action_log_probs", "base_action_log_probs", "values"):
        assert torch.equal(getattr(back, name), getattr(forward, name)), name
    assert back.action_entropy is None

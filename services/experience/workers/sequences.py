"""Build padded sequences and masks from finished completions (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastexp.types import Rollout
from services.common.generation import CompletionRecord
from services.experience.config import PromptSpec
from services.experience.workers.vision import VisionTokens, repair_placeholders, stack_rows


def build_rollout(
    completions: Sequence[CompletionRecord],
    prompts: Sequence[PromptSpec],
    pad_token_id: int,
    vision_tokens: VisionTokens | None = None,
) -> Rollout:
    """Left-pad prompts and right-pad responses into one (B, S) batch, as the seed lays out experiences.

    ``action_mask`` is built from each response's length, not from token ids: the embedded model's pad token
    equals its EOS token, so the seed's ``sequences != eos & sequences != pad`` test would drop the final EOS. A
    multi-turn episode's record brings its own mask (0 on observation tokens); ``response_length`` counts every
    response token, observations included (the row's length after its prompt).

    Multimodal rows take their prompt from the processor (``PromptSpec.model_token_ids``, whose placeholders
    match their pixel patches); a generator prompt that differs (another processor configuration) is counted in
    ``vision_prompt_mismatches``. With ``vision_tokens`` (a vision-language policy), placeholders the policy
    sampled in responses are replaced by ``pad_token_id`` (:func:`services.experience.workers.vision.repair_placeholders`).

    Shape:
        completions: B records; ``S = max prompt length + A``, ``A = max response length`` (>= 1).
    """
    prompt_ids = []
    mismatches = 0
    for c in completions:
        spec = prompts[c.prompt_index]
        if spec.vision is not None:
            mismatches += c.prompt_token_ids != spec.vision.token_ids
            prompt_ids.append(spec.vision.token_ids)
        else:
            prompt_ids.append(c.prompt_token_ids)
    prompt_width = max(len(p) for p in prompt_ids)
    num_actions = max(1, max(len(c.output_token_ids) for c in completions))
    batch = len(completions)
    sequences = torch.full((batch, prompt_width + num_actions), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros_like(sequences)
    action_mask = torch.zeros((batch, num_actions), dtype=torch.bool)
    rollout_log_probs = torch.zeros((batch, num_actions), dtype=torch.float32)
    for row, (c, prompt) in enumerate(zip(completions, prompt_ids, strict=True)):
        p, t = len(prompt), len(c.output_token_ids)
        sequences[row, prompt_width - p : prompt_width] = torch.tensor(prompt)
        attention_mask[row, prompt_width - p : prompt_width + t] = 1
        if t:
            sequences[row, prompt_width : prompt_width + t] = torch.tensor(c.output_token_ids)
            rollout_log_probs[row, :t] = torch.tensor(c.output_log_probs, dtype=torch.float32)
        if c.action_mask is None:
            action_mask[row, :t] = True
        elif t:  # a multi-turn episode: the model's tokens only, not the observations between its turns
            action_mask[row, :t] = torch.tensor(c.action_mask, dtype=torch.bool)
    response_length = torch.tensor([len(c.output_token_ids) for c in completions], dtype=torch.int64)
    vision = stack_rows([prompts[c.prompt_index].vision for c in completions])
    sequences, repaired = repair_placeholders(sequences, vision, vision_tokens, pad_token_id)
    return Rollout(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        response_length=response_length,
        total_length=attention_mask.sum(dim=1),
        prompt_index=tuple(c.prompt_index for c in completions),
        sample_index=tuple(c.sample_index for c in completions),
        prompt_texts=tuple(prompts[c.prompt_index].text for c in completions),
        response_texts=tuple(c.text for c in completions),
        policy_version=tuple(c.policy_version for c in completions),
        rollout_log_probs=rollout_log_probs,
        vision=vision,
        repaired_vision_tokens=repaired,
        vision_prompt_mismatches=mismatches,
        num_turns=tuple(c.num_turns for c in completions),
    )

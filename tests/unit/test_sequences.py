import numpy as np
import torch

from services.common.generation import CompletionRecord
from services.experience.config import PromptSpec
from services.experience.workers.sequences import build_rollout

PAD = 2  # SmolLM2: pad == eos == 2


def _completion(p, s, prompt, output):
    return CompletionRecord(p, s, tuple(prompt), tuple(output), np.arange(len(output), dtype=np.float32) - 9,
                            "stop", f"r{p}{s}", policy_version=7)


def test_left_padded_prompts_right_padded_responses_and_eos_kept():
    prompts = [PromptSpec("a", (10, 11, 12), "", ""), PromptSpec("b", (20,), "", "")]
    rollout = build_rollout(
        [_completion(0, 0, [10, 11, 12], [5, PAD]), _completion(1, 0, [20], [6, 7, 8, PAD])], prompts, PAD
    )
    # S = 3 (widest prompt) + 4 (longest response)
    assert rollout.sequences.tolist() == [[10, 11, 12, 5, PAD, PAD, PAD], [PAD, PAD, 20, 6, 7, 8, PAD]]
    assert rollout.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    # the EOS (== pad id) that the model sampled is an action; padding after it is not
    assert rollout.action_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert rollout.response_length.tolist() == [2, 4]
    assert rollout.total_length.tolist() == [5, 5]
    assert rollout.prompt_texts == ("a", "b") and rollout.policy_version == (7, 7)
    assert torch.equal(rollout.rollout_log_probs[0], torch.tensor([-9.0, -8.0, 0.0, 0.0]))

"""Observations appended token-exactly (services.experience.pipeline.episodes.ObservationRenderer): a prompt, the model's
sampled turn, the template's end-of-turn separator and the rendered observation are exactly the tokens of the
whole conversation rendered by the chat template, for SmolLM2's (ChatML) and Qwen3's templates, ``user`` and
``tool`` roles."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.experience.pipeline.episodes import ObservationRenderer

QWEN3 = Path(".venv/share/qwen3-tokenizer/package/models")


def _ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(params=["smollm2", "qwen3"])
def tokenizer(request, smollm2_path):
    if request.param == "qwen3":
        if not QWEN3.is_dir():
            pytest.fail(f"{QWEN3} is missing: `make venv` unpacks it")
        return AutoTokenizer.from_pretrained(QWEN3)
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("role", ["user", "tool"])
def test_prompt_turn_and_observation_are_the_templates_rendering_of_the_conversation(tokenizer, role):
    renderer = ObservationRenderer(tokenizer)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    answer, feedback = "The answer is \\boxed{6}.", "That is not correct. Try again."
    prompt = _ids(tokenizer, question, generation_prompt=True)
    sampled = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    appended = [*prompt, *sampled, *renderer.after_turn, *renderer.observation_ids(feedback, role)]
    conversation = [*question, {"role": "assistant", "content": answer}, {"role": role, "content": feedback}]
    assert appended == _ids(tokenizer, conversation, generation_prompt=True)
    assert appended[-len(renderer.generation_prompt):] == renderer.generation_prompt

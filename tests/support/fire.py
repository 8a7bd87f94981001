"""FIRE sampling checks shared by the HF and vLLM tests: near-greedy decoding after a hot first token."""

from __future__ import annotations

from collections import defaultdict

from fastexp.v1 import generation_pb2

#: Later tokens at a temperature this low are the argmax; the first token at FIRE's hot temperature is not.
COLD, HOT = 1e-3, 50.0


def fire_request(first_token_temperature: float | None, n: int = 16) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(temperature=COLD, max_new_tokens=6)
    if first_token_temperature is not None:
        sampling.first_token_temperature = first_token_temperature
    return generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(text="Count: one, two,")], n_samples_per_prompt=n, sampling=sampling
    )


def assert_only_the_first_token_is_hot(with_fire: list, without_fire: list) -> None:
    """Without FIRE every sample is the greedy one; with it the first tokens spread out, and samples that share a
    first token share the whole (greedy) continuation: only the first token's temperature changed."""
    assert len({tuple(c.output_token_ids) for c in without_fire}) == 1
    continuations = defaultdict(set)
    for completion in with_fire:
        continuations[completion.output_token_ids[0]].add(tuple(completion.output_token_ids[1:]))
    assert len(continuations) >= len(with_fire) // 2, "the first token was not sampled hot"
    assert all(len(tails) == 1 for tails in continuations.values()), "a later token was not sampled cold"

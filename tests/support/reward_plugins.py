"""Rule functions and an aggregation reward_fn, named by import path in the tests' scorer configurations.

They are real plugins of the kind a reward team writes; the misbehaving ones exist to test fault isolation.
"""

from __future__ import annotations

import time

import torch


def length_reward(response: str, reference: str) -> tuple[float, dict[str, float]]:
    """len(response) / 10, with the length as a metric."""
    return len(response) / 10, {"chars": float(len(response))}


def contains_reference(response: str, reference: str) -> float:
    """1.0 when the reference text occurs in the response."""
    return float(bool(reference) and reference in response)


def misbehaving_rule(response: str, reference: str) -> float:
    """Hangs on "hang", raises on "crash", returns NaN on "nan" and a string on "text"; else 1.0."""
    if "hang" in response:
        time.sleep(60)
    if "crash" in response:
        raise RuntimeError("verifier bug")
    if "nan" in response:
        return float("nan")
    if "text" in response:
        return "one"  # type: ignore[return-value]
    return 1.0


def seed_custom_reward_func(queries, prompts, labels):
    """The seed's batch signature: 1.0 where the response (the query after its prompt) contains the label, as a
    tensor; raises on a prompt "crash" (the whole batch fails); sleeps on "hang"."""
    if "crash" in prompts:
        raise RuntimeError("batch verifier bug")
    if "hang" in prompts:
        time.sleep(60)
    rows = zip(queries, prompts, labels, strict=True)
    return torch.tensor([float(label in query[len(prompt):]) for query, prompt, label in rows])


def wrong_count_reward_func(queries, prompts, labels):
    """A batch rule that returns one reward too few."""
    return [0.0] * (len(queries) - 1)


class MeanEmbeddingReward(torch.nn.Module):
    """A reward model that is not an HF sequence classifier: mean of a token embedding over the attention mask,
    then a linear head (the kind of module the seed accepts: ``module(input_ids, attention_mask) -> (B,)``)."""

    def __init__(self, vocab_size: int, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)  # (B, 1)


def build_mean_embedding_reward(vocab_size: int, seed: int = 0) -> MeanEmbeddingReward:
    """The factory a scorer configuration names (``factory_options: {vocab_size: ..., seed: ...}``)."""
    return MeanEmbeddingReward(vocab_size, seed=seed)


def build_not_a_module() -> str:
    return "not a module"


def max_reward_fn(model_reward_list, labels, queries, refs, label_map):
    """Aggregation: the largest source reward, plus how many sources were positive."""
    stacked = torch.stack(model_reward_list)
    return stacked.max(dim=0).values, {"positive_sources": (stacked > 0).sum(dim=0).float()}


not_callable = 3


def length_and_reference_reward(response: str, reference: str) -> tuple[float, dict[str, float]]:
    """len(response) / 10 + len(reference): varies with the response (a learning signal even for a random model)
    and shows the reference arrived; the response's length in characters as a metric."""
    return len(response) / 10 + len(reference), {"chars": float(len(response))}

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


def max_reward_fn(model_reward_list, labels, queries, refs, label_map):
    """Aggregation: the largest source reward, plus how many sources were positive."""
    stacked = torch.stack(model_reward_list)
    return stacked.max(dim=0).values, {"positive_sources": (stacked > 0).sum(dim=0).float()}


not_callable = 3

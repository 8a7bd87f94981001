"""Rule-based reward functions. Each runs inside a verifier worker process (see :mod:`services.scorer.scorer`).

A rule function takes ``(response, reference)`` texts and returns ``(reward, metrics)``; it must be a module-level
function so the worker process can import it.
"""

from __future__ import annotations


def math_verify_reward(response: str, reference: str) -> tuple[float, dict[str, float]]:
    """1.0 when the response's final answer equals the reference answer, else 0.0.

    Both texts are parsed by HF's math-verify (LaTeX and plain expressions; the last answer found in the response
    counts) and compared symbolically with ``math_verify.verify``. An empty reference scores 0.

    Returns:
        ``(reward, {"correct": 0|1, "answer_found": 0|1})``.
    """
    from math_verify import parse, verify

    gold = parse(reference) if reference else []
    predicted = parse(response)
    correct = bool(gold) and bool(predicted) and verify(gold, predicted)
    return float(correct), {"correct": float(correct), "answer_found": float(bool(predicted))}


RULES = {"math_verify": math_verify_reward}

"""The rule scorer on real math-verify, with a hard per-item timeout in worker processes."""

import time

import pytest

from services.common.errors import InvalidRequest
from services.scorer.rules import math_verify_reward
from services.scorer.scorer import RuleScorer, ScoreItem, make_items


def hanging_rule(response: str, reference: str):
    if response == "hang":
        time.sleep(60)
    if response == "crash":
        raise RuntimeError("verifier bug")
    return math_verify_reward(response, reference)


def test_math_verify_reward():
    assert math_verify_reward("so the answer is \\boxed{42}", "42") == (1.0, {"correct": 1.0, "answer_found": 1.0})
    assert math_verify_reward("I think it is 41.", "42")[0] == 0.0
    assert math_verify_reward("no idea", "42")[1]["answer_found"] == 0.0
    assert math_verify_reward("42", "")[0] == 0.0


def test_make_items_splits_queries_and_validates():
    (item,) = make_items(["Q: 1+1? A: 2"], ["Q: 1+1? A:"], [], ["2"])
    assert item.response == " 2" and item.reference == "2" and item.label == ""
    with pytest.raises(InvalidRequest, match="queries\\[0\\]"):
        make_items(["abc"], ["x"], [], [])
    with pytest.raises(InvalidRequest, match="references"):
        make_items(["abc"], ["a"], [], ["1", "2"])


async def test_a_hanging_or_crashing_item_costs_only_that_item():
    scorer = RuleScorer(hanging_rule, workers=2, timeout_s=3.0)
    try:
        items = [ScoreItem("", "", text, "", "7") for text in ("hang", "The answer is 7.", "crash", "8")]
        started = time.monotonic()
        result = await scorer.score(items)
        assert time.monotonic() - started < 30
        assert result.rewards.tolist() == [0.0, 1.0, 0.0, 0.0]
        assert result.metrics["verifier_timeout"].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert result.metrics["verifier_error"].tolist() == [0.0, 0.0, 1.0, 0.0]
        # the pool replaced the killed worker and still scores
        again = await scorer.score([ScoreItem("", "", "7", "", "7")])
        assert again.rewards.tolist() == [1.0]
    finally:
        await scorer.close()

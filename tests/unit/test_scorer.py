"""Rule sources named by import path (real worker processes) and their composition: recipes, reward_fn, faults."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from services.common.errors import InvalidRequest
from services.scorer.composition import ConfigError, build_composer
from services.scorer.rules import RuleScorer, boxed_format_reward, import_callable, math_verify_reward
from services.scorer.scorer import ScoreItem, make_items
from services.scorer.settings import ScorerSettings

PLUGINS = "tests.support.reward_plugins"


def item(response: str, reference: str = "7", label: str = "") -> ScoreItem:
    return ScoreItem(query="Q:" + response, prompt="Q:", response=response, label=label, reference=reference)


def rule(name: str, function: str, **extra) -> dict:
    return {"type": "rule", "name": name, "function": f"{PLUGINS}:{function}", "workers": 1, **extra}


def test_math_verify_reward():
    assert math_verify_reward("so the answer is \\boxed{42}", "42") == (1.0, {"correct": 1.0, "answer_found": 1.0})
    assert math_verify_reward("I think it is 41.", "42")[0] == 0.0
    assert math_verify_reward("no idea", "42")[1]["answer_found"] == 0.0
    assert math_verify_reward("42", "")[0] == 0.0


def test_boxed_format_reward():
    assert boxed_format_reward("so \\boxed{3}", "") == 1.0
    assert boxed_format_reward("\\boxed{3} or \\boxed{4}", "") == 0.0
    assert boxed_format_reward("3", "") == 0.0


def test_make_items_splits_queries_and_validates():
    (one,) = make_items(["Q: 1+1? A: 2"], ["Q: 1+1? A:"], [], ["2"])
    assert one.response == " 2" and one.reference == "2" and one.label == ""
    (whole,) = make_items(["just a response"], [], ["math"], [])
    assert whole.response == "just a response" and whole.label == "math"
    with pytest.raises(InvalidRequest, match="queries\\[0\\]"):
        make_items(["abc"], ["x"], [], [])
    with pytest.raises(InvalidRequest, match="references"):
        make_items(["abc"], ["a"], [], ["1", "2"])


def test_import_callable_names_the_path():
    assert import_callable(f"{PLUGINS}:length_reward")("abc", "")[0] == pytest.approx(0.3)
    assert import_callable(f"{PLUGINS}.length_reward") is import_callable(f"{PLUGINS}:length_reward")
    with pytest.raises(ImportError, match="no_such_module"):
        import_callable("no_such_module:f")
    with pytest.raises(ImportError, match="missing"):
        import_callable(f"{PLUGINS}:missing")
    with pytest.raises(TypeError, match="not callable"):
        import_callable(f"{PLUGINS}:not_callable")


async def test_a_hanging_crashing_or_non_numeric_rule_costs_only_that_item():
    scorer = RuleScorer("check", f"{PLUGINS}:misbehaving_rule", workers=2, timeout_s=3.0)
    await scorer.start()
    try:
        items = [item(text) for text in ("hang", "fine", "crash", "nan", "text")]
        result = await scorer.score(items)
        assert result.rewards[1] == 1.0 and np.isnan(result.rewards[[0, 2, 3, 4]]).all()
        assert result.errors[1] is None
        assert "timed out after 3 s" in result.errors[0]
        assert "RuntimeError: verifier bug" in result.errors[2]
        assert "reward 3 is nan" in result.errors[3]
        assert "'one', not a number" in result.errors[4]
        assert result.metrics["timeout"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
        # the pool replaced the killed worker and still scores
        again = await scorer.score([item("fine")])
        assert again.rewards.tolist() == [1.0]
    finally:
        await scorer.close()


def test_settings_refuse_unknown_names_listing_each():
    with pytest.raises(ValidationError) as caught:
        ScorerSettings(
            sources=[rule("a", "length_reward"), rule("a", "length_reward"), rule("b", "length_reward")],
            recipes={"math": [("rule", "nope", 1.0), ("model", "b", 1.0)]},
            reward_fn_label_map={"ghost": 0},
        )
    message = str(caught.value)
    assert "duplicate names ['a']" in message
    assert "recipes.math: unknown source 'nope'" in message
    assert "source 'b' is a rule source" in message
    assert "reward_fn_label_map: unknown source 'ghost'" in message
    with pytest.raises(ValidationError, match="several sources need recipes or a reward_fn"):
        ScorerSettings(sources=[rule("a", "length_reward"), rule("b", "length_reward")])


def test_build_refuses_import_paths_that_do_not_resolve():
    settings = ScorerSettings(
        sources=[rule("a", "missing"), {"type": "rule", "name": "b", "function": "nowhere.at_all:f"}],
        recipes={"default": [("rule", "a", 1.0), ("rule", "b", 1.0)]},
        reward_fn=f"{PLUGINS}:also_missing",
    )
    with pytest.raises(ConfigError) as caught:
        build_composer(settings)
    for name in ("reward_fn", "also_missing", "sources.a.function", "sources.b.function", "nowhere"):
        assert name in str(caught.value)


async def test_a_missing_model_folder_refuses_to_start():
    settings = ScorerSettings(sources=[{"type": "model", "name": "rm", "path": "/no/such/folder"}])
    composer = build_composer(settings)
    with pytest.raises(ConfigError, match="rm: .*'/no/such/folder' does not exist"):
        await composer.start()


@pytest.fixture(scope="module")
async def recipe_composer():
    """Two rule sources; math samples use both (weights 1 and 0.5), chat samples only the length rule."""
    settings = ScorerSettings(
        sources=[rule("length", "length_reward"), rule("match", "contains_reference")],
        recipes={
            "math": [("rule", "match", 1.0), ("rule", "length", 0.5)],
            "chat": [("rule", "length", 2.0), ("rule", "match", 0.0)],
        },
    )
    composer = build_composer(settings)
    await composer.start()
    yield composer
    await composer.close()


async def test_recipes_run_only_the_sources_a_sample_needs_and_sum_with_weights(recipe_composer):
    items = [item("the answer is 7", label="math"), item("hello", label="chat"), item("8", label="math")]
    result = await recipe_composer.score(items)
    length = np.array([15, 5, 1]) / 10
    # math: 1.0 * match + 0.5 * length; chat: 2.0 * length (match has weight 0, so it does not run)
    assert result.rewards.tolist() == pytest.approx([1.0 + 0.5 * length[0], 2.0 * length[1], 0.0 + 0.5 * length[2]])
    assert result.metrics["length/reward"].tolist() == pytest.approx(length.tolist())
    match = result.metrics["match/reward"]
    assert match[0] == 1.0 and math.isnan(match[1]) and match[2] == 0.0
    assert result.metrics["length/chars"].tolist() == [15.0, 5.0, 1.0]
    assert result.metrics["match/failed"].tolist() == [0.0, 0.0, 0.0]
    assert result.errors == (None, None, None)


async def test_a_label_without_recipe_is_invalid_argument_naming_it(recipe_composer):
    with pytest.raises(InvalidRequest, match="labels\\[1\\].*'poetry'"):
        await recipe_composer.score([item("x", label="math"), item("y", label="poetry")])


async def test_reward_fn_aggregates_in_label_map_order():
    settings = ScorerSettings(
        sources=[rule("length", "length_reward"), rule("match", "contains_reference")],
        reward_fn=f"{PLUGINS}:max_reward_fn",
        reward_fn_label_map={"match": 0, "length": 1},
        recipes={"default": [("rule", "length", 1.0), ("rule", "match", 1.0)], "short": [("rule", "match", 1.0)]},
    )
    composer = build_composer(settings)
    await composer.start()
    try:
        result = await composer.score([item("7 is it"), item("nope, 8"), item("a very long answer", label="short")])
        # max(match, length); the "short" recipe does not run length, which reward_fn then sees as 0.0
        assert result.rewards.tolist() == pytest.approx([1.0, 0.7, 0.0])
        assert result.metrics["positive_sources"].tolist() == [2.0, 1.0, 0.0]
        assert math.isnan(result.metrics["length/reward"][2])
    finally:
        await composer.close()


async def test_failures_fail_the_item_unless_a_fallback_is_configured():
    settings = ScorerSettings(
        sources=[rule("strict", "misbehaving_rule", timeout_s=3.0),
                 rule("lenient", "misbehaving_rule", timeout_s=3.0, fallback_reward=-1.0)],
        recipes={"strict": [("rule", "strict", 1.0)], "lenient": [("rule", "lenient", 1.0)]},
    )
    composer = build_composer(settings)
    await composer.start()
    try:
        result = await composer.score(
            [item("crash", label="strict"), item("ok", label="strict"), item("crash", label="lenient")]
        )
        assert math.isnan(result.rewards[0]) and "strict: rule raised RuntimeError" in result.errors[0]
        assert result.rewards[1] == 1.0 and result.errors[1] is None
        # the documented fallback: the reward is the configured value and the failure is still reported
        assert result.rewards[2] == -1.0 and result.errors[2] is None
        assert result.metrics["lenient/failed"].tolist() == [0.0, 0.0, 1.0]
        assert result.metrics["strict/failed"].tolist() == [1.0, 0.0, 0.0]
    finally:
        await composer.close()


async def test_a_batch_rule_with_the_seeds_signature_scores_a_whole_batch_in_one_call():
    """``signature: batch``: the seed's custom_reward_func(queries, prompts, labels), in a worker process; a crash,
    a hang or a wrong count costs that batch (with the fallback, if configured), never the service."""
    settings = ScorerSettings(sources=[rule("seed", "seed_custom_reward_func", signature="batch", timeout_s=3.0,
                                            fallback_reward=-1.0)])
    composer = build_composer(settings)
    await composer.start()
    try:
        items = [ScoreItem(query="Q: the answer is 7", prompt="Q:", response=" the answer is 7", label="7",
                           reference=""),
                 ScoreItem(query="Q: 8", prompt="Q:", response=" 8", label="7", reference="")]
        assert (await composer.score(items)).rewards.tolist() == [1.0, 0.0]
        crash = [ScoreItem(query="crash 7", prompt="crash", response=" 7", label="7", reference="")] * 2
        result = await composer.score(crash)  # the configured fallback, the failure still reported
        assert result.rewards.tolist() == [-1.0, -1.0] and result.metrics["seed/failed"].tolist() == [1.0, 1.0]
        scorer = RuleScorer("raw", f"{PLUGINS}:seed_custom_reward_func", workers=1, timeout_s=3.0, batched=True)
        counting = RuleScorer("count", f"{PLUGINS}:wrong_count_reward_func", workers=1, timeout_s=3.0, batched=True)
        await scorer.start()
        await counting.start()
        try:
            for prompt, why in (("crash", "raw: batch rule raised RuntimeError: batch verifier bug"),
                                ("hang", "raw: batch rule timed out after 3 s")):
                bad = [ScoreItem(query=prompt + " 7", prompt=prompt, response=" 7", label="7", reference="")] * 2
                result = await scorer.score(bad)
                assert np.isnan(result.rewards).all() and result.errors == (why, why)
            result = await counting.score(items)
            assert np.isnan(result.rewards).all() and "returned 1 rewards for 2 queries" in result.errors[0]
            assert (await scorer.score(items[:1])).rewards.tolist() == [1.0]  # the killed worker was replaced
        finally:
            await scorer.close()
            await counting.close()
    finally:
        await composer.close()

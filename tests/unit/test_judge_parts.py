"""The judge's and the gateway's pure parts: verdict parsing (garbage included), templates, reward mapping, breaker
transitions, cache keys, budgets' admission, and the configuration's errors naming their fields."""

from __future__ import annotations

import asyncio
import math

import pytest
from pydantic import ValidationError

from services.common.deadlines import Deadline
from services.scorer.judges.config import JudgeConfig, VerdictConfig
from services.scorer.judges.verdicts import parse_number, parse_verdict, render, to_reward, yes_probability
from services.scorer.outbound.breaker import (
    Admission,
    BreakerOpen,
    BreakerState,
    BreakerStatus,
    abandoned,
    admit,
    failed,
    succeeded,
)
from services.scorer.outbound.budgets import Budget, BudgetTimeout
from services.scorer.outbound.cache import CachedReward, LocalCache, cache_key, fingerprint
from services.scorer.outbound.config import BreakerConfig, BudgetConfig, CacheConfig
from services.scorer.outbound.guard import CallGuard, SourceUnavailable, after_tries
from services.scorer.settings import ScorerSettings

BOXED, JSON = VerdictConfig(kind="boxed"), VerdictConfig(kind="json", field="verdict.score")
REGEX = VerdictConfig(kind="regex", pattern=r"Score:\s*(\S+)")
YES_NO = VerdictConfig(kind="yes_no")


@pytest.mark.parametrize("text,score", [
    ("so \\boxed{7}", 7.0), ("\\boxed{1} then \\boxed{ 0.25 }", 0.25), ("\\boxed{3/4}", 0.75),
    ("\\boxed{80\\%}", 0.8), ("\\boxed{-2e1}", -20.0),
])
def test_boxed_verdicts_read_the_last_box(text, score):
    assert parse_verdict(text, BOXED).score == pytest.approx(score)


@pytest.mark.parametrize("text,why", [
    ("no box at all", "no \\boxed{}"), ("\\boxed{seven}", "'seven' is not a number"), ("\\boxed{7", "no \\boxed{}"),
    ("\\boxed{nan}", "not a number"), ("\\boxed{1/0}", "not a number"), ("", "no \\boxed{}"),
    ("\\boxed{\\frac{1}{2}}", "not a number"),
])
def test_garbage_is_an_error_quoting_the_answer_never_a_number(text, why):
    verdict = parse_verdict(text, BOXED)
    assert verdict.score is None and why in verdict.error and repr(text[:20])[1:-1] in verdict.error


def test_regex_and_json_verdicts():
    assert parse_verdict("Reasoning... Score: 9", REGEX).score == 9.0
    assert "no match" in parse_verdict("Score 9", REGEX).error
    assert parse_verdict('```json\n{"verdict": {"score": 4}}\n```', JSON).score == 4.0
    assert parse_verdict('{"verdict": {"score": "0.5"}} and {"other": 1}', JSON).score == 0.5
    assert parse_verdict('{"verdict": {"score": true}}', JSON).score == 1.0
    assert "no JSON object" in parse_verdict('{"verdict": {"score": null}}', JSON).error
    assert "no JSON object" in parse_verdict("{not json", JSON).error


def test_yes_no_is_the_probability_ratio_of_yes_and_no_tokens():
    lp = {" Yes": math.log(0.6), "No": math.log(0.2), "Maybe": math.log(0.2)}
    assert yes_probability(lp, ("Yes",), ("No",)) == pytest.approx(0.75)  # 0.6 / (0.6 + 0.2)
    assert parse_verdict("Yes", YES_NO, lp).score == pytest.approx(0.75)
    assert parse_verdict("Yes", YES_NO, {"Yes": 0.0}).score == 1.0  # "No" not among the candidates: 0
    assert "no log-probs" in parse_verdict("Yes", YES_NO, None).error
    assert "neither yes nor no" in parse_verdict("Perhaps", YES_NO, {"Perhaps": 0.0}).error


def test_templates_fill_known_fields_and_keep_other_braces():
    text = render("Q: {prompt}\nA: {response}\nRef: {reference} [{label}] \\boxed{score} {x}",
                  {"prompt": "1+1?", "response": "2", "reference": "2", "label": "math"})
    assert text == "Q: 1+1?\nA: 2\nRef: 2 [math] \\boxed{score} {x}"
    assert parse_number("12%") == 0.12 and parse_number("1,000") is None


def test_scores_map_linearly_and_out_of_range_is_none():
    assert to_reward(7, (0, 10), (0, 1)) == pytest.approx(0.7)
    assert to_reward(0, (0, 10), (-1, 1)) == -1 and to_reward(10, (0, 10), (-1, 1)) == 1
    assert to_reward(11, (0, 10), (0, 1)) is None and to_reward(-0.1, (0, 10), (0, 1)) is None


def test_breaker_opens_after_consecutive_failures_probes_half_open_and_closes_on_success():
    config = BreakerConfig(failure_threshold=2, open_s=10, half_open_probes=1)
    call, state = admit(BreakerState(), 0.0, config)
    state = failed(state, call, 0.0, config, "down")
    assert state.status is BreakerStatus.CLOSED and succeeded(state, call) == BreakerState()  # an answer resets
    state = failed(state, call, 1.0, config, "down")
    assert state.status is BreakerStatus.OPEN and state.opened_at == 1.0 and state.generation == 1
    assert admit(state, 10.9, config) == (None, state)  # still open
    probe, probing = admit(state, 11.0, config)
    assert probe == Admission(2) and probing.status is BreakerStatus.HALF_OPEN and probing.probes == 1
    assert admit(probing, 11.0, config)[0] is None  # one probe at a time
    assert abandoned(probing, probe).probes == 0  # a cancelled probe frees its place
    reopened = failed(probing, probe, 12.0, config, "still down")
    assert reopened.status is BreakerStatus.OPEN and reopened.opened_at == 12.0 and reopened.generation == 3
    assert succeeded(probing, probe) == BreakerState(generation=3)
    assert admit(reopened, 12.0, BreakerConfig(enabled=False))[0] is not None


def _opened_with_a_call_in_flight(config: BreakerConfig):
    """A call admitted while closed and still in flight, and the state once another call's failure opened it (at
    ``failure_threshold`` 1)."""
    early, state = admit(BreakerState(), 0.0, config)
    other, state = admit(state, 0.0, config)
    return early, failed(state, other, 0.0, config, "HTTP 503")


def test_guide_while_half_open_only_its_probes_decide():
    # "up to `half_open_probes` calls go through; the first that gets an answer closes it, a failed one opens it
    # again" and "a call sent before it opened ... does not close it": a call admitted before the breaker opened,
    # or a probe of an earlier half-open period, that answers, fails or is cancelled while half-open changes nothing
    config = BreakerConfig(failure_threshold=1, open_s=10, half_open_probes=1)
    early, opened = _opened_with_a_call_in_flight(config)
    stale_probe, half_open = admit(opened, 10.0, config)
    reopened = failed(half_open, stale_probe, 11.0, config, "HTTP 503")
    probe, half_open = admit(reopened, 21.0, config)
    for late in (early, stale_probe):
        assert succeeded(half_open, late) == half_open
        assert failed(half_open, late, 22.0, config, "HTTP 503") == half_open
        assert abandoned(half_open, late) == half_open and admit(half_open, 22.0, config)[0] is None  # still one
    assert succeeded(half_open, probe).status is BreakerStatus.CLOSED


def test_guide_the_first_probe_to_answer_closes_it_and_the_others_outcomes_are_late():
    # with half_open_probes 2, "the first that gets an answer closes it": the second probe failing afterwards, or
    # a call admitted before the breaker opened failing once it has closed again, does not reopen it or count
    config = BreakerConfig(failure_threshold=1, open_s=10, half_open_probes=2)
    early, opened = _opened_with_a_call_in_flight(config)
    first, state = admit(opened, 10.0, config)
    second, state = admit(state, 10.0, config)
    assert state.probes == 2 and admit(state, 10.0, config)[0] is None
    closed = succeeded(state, first)
    assert closed.status is BreakerStatus.CLOSED
    for late in (second, early):
        assert failed(closed, late, 11.0, config, "HTTP 503") == closed
        assert succeeded(closed, late) == closed and abandoned(closed, late) == closed
    now, closed = admit(closed, 11.0, config)  # a call of the closed generation counts again
    assert failed(closed, now, 11.0, config, "HTTP 503").status is BreakerStatus.OPEN


def test_cache_keys_change_with_every_part_and_the_reward_deciding_configuration():
    judge = JudgeConfig(name="a", backend="openai", url="http://j/v1", template="{response}")
    base = fingerprint(judge)
    assert fingerprint(judge.model_copy(update={"name": "b", "timeout_s": 5.0, "budget": BudgetConfig()})) == base
    assert fingerprint(judge.model_copy(update={"template": "{response}!"})) != base
    assert fingerprint(judge, "v2") != base
    keys = {cache_key(base, *parts) for parts in
            [("p", "r", "ref", "l"), ("p", "r", "ref", ""), ("p", "r", "", "l"), ("p", "", "ref", "l"),
             ("", "r", "ref", "l"), ("pr", "", "ref", "l")]}
    assert len(keys) == 6


async def test_local_cache_is_bounded_lru():
    cache = LocalCache(CacheConfig(max_entries=2))
    await cache.put_many({"a": CachedReward(1.0, {}), "b": CachedReward(2.0, {})})
    assert (await cache.get_many(["a"]))[0].reward == 1.0  # "a" used: "b" is least recent
    await cache.put_many({"c": CachedReward(3.0, {"m": 0.5})})
    assert [e and e.reward for e in await cache.get_many(["a", "b", "c"])] == [1.0, None, 3.0]
    assert CachedReward.from_json(CachedReward(3.0, {"m": 0.5}).to_json()) == CachedReward(3.0, {"m": 0.5})
    assert CachedReward.from_json(b"garbage") is None


async def test_budgets_admit_what_the_buckets_hold_and_queue_the_rest_within_the_deadline():
    """Rates refill over a minute, so within a 1 s deadline exactly the bucket's size is admitted."""
    requests = Budget("rpm", BudgetConfig(max_concurrency=8, requests_per_minute=4))
    tokens = Budget("tpm", BudgetConfig(max_concurrency=8, tokens_per_minute=100))

    async def take(budget: Budget, amount: int) -> bool:
        try:
            async with budget.slot(amount, Deadline.from_remaining(1.0)):
                return True
        except BudgetTimeout as error:
            assert "queued for the budget" in str(error)
            return False

    assert sum(await asyncio.gather(*(take(requests, 1) for _ in range(6)))) == 4
    assert sum(await asyncio.gather(*(take(tokens, 40) for _ in range(4)))) == 2  # 80 of 100 tokens; 120 > 100


async def test_gateway_fails_fast_with_the_breaker_named_once_open():
    gateway = CallGuard("judge", BudgetConfig(), BreakerConfig(failure_threshold=2, open_s=60))
    calls = []

    async def down(timeout_s: float) -> None:
        calls.append(1)
        raise SourceUnavailable("connection refused")

    for _ in range(2):
        with pytest.raises(SourceUnavailable):
            await gateway.call(down, tokens=1, deadline=Deadline(), timeout_s=5.0, max_attempts=1, backoff_initial_s=0.01,
                               backoff_max_s=0.01)
    with pytest.raises(BreakerOpen, match="circuit breaker open .2 consecutive failures.*connection refused"):
        await gateway.call(down, tokens=1, deadline=Deadline(), timeout_s=5.0, max_attempts=3, backoff_initial_s=0.01,
                           backoff_max_s=0.01)
    assert len(calls) == 2  # the refused call never reached the endpoint


async def _fail_calls(gateway: CallGuard, count: int, max_attempts: int) -> list[int]:
    """``count`` calls to an endpoint that is down, each retried ``max_attempts`` times; the tries sent."""
    tries: list[int] = []

    async def down(timeout_s: float) -> None:
        tries.append(1)
        raise SourceUnavailable("HTTP 503")

    for _ in range(count):
        with pytest.raises(SourceUnavailable):
            await gateway.call(down, tokens=1, deadline=Deadline(), timeout_s=5.0, max_attempts=max_attempts,
                               backoff_initial_s=0.001, backoff_max_s=0.001)
    return tries


async def test_guide_a_failed_call_counts_once_after_its_retries():
    # docs/reward-teams/judges.md: "`failure_threshold` consecutive failed calls (..., each after its retries) open it"
    gateway = CallGuard("judge-retries", BudgetConfig(), BreakerConfig(failure_threshold=3, open_s=60))
    assert len(await _fail_calls(gateway, 2, max_attempts=2)) == 4  # two calls, four tries
    assert gateway.breaker.state.status is BreakerStatus.CLOSED and gateway.breaker.state.failures == 2
    await _fail_calls(gateway, 1, max_attempts=2)
    assert gateway.breaker.state.status is BreakerStatus.OPEN  # the third call


async def test_guide_enabled_false_turns_the_breaker_off():
    # "`breaker: {enabled: false}` turns it off": never open, in its state, its gauge and its health
    from prometheus_client import REGISTRY

    gateway = CallGuard("judge-no-breaker", BudgetConfig(), BreakerConfig(enabled=False, failure_threshold=1))
    statuses = []
    gateway.breaker.listen(statuses.append)
    assert len(await _fail_calls(gateway, 5, max_attempts=1)) == 5  # every call reached the endpoint
    assert gateway.breaker.state.status is BreakerStatus.CLOSED and statuses == []
    assert REGISTRY.get_sample_value("fastexp_reward_source_breaker_state", {"source": "judge-no-breaker"}) == 0
    assert gateway.breaker.describe() == "circuit breaker off (5 consecutive failures)"  # as item errors say it


async def test_guide_each_source_has_a_breaker_of_its_own_even_on_one_endpoint():
    # "Each networked source has a breaker of its own": two sources on one endpoint count their own calls
    first = CallGuard("judge-a", BudgetConfig(), BreakerConfig(failure_threshold=2))
    second = CallGuard("judge-b", BudgetConfig(), BreakerConfig(failure_threshold=2))
    await _fail_calls(first, 2, max_attempts=1)
    assert first.breaker.state.status is BreakerStatus.OPEN
    assert second.breaker.state.status is BreakerStatus.CLOSED and second.breaker.state.failures == 0


def test_judge_configuration_errors_name_the_field():
    def problems(**fields) -> str:
        entry = {"type": "judge", "name": "j", "backend": "openai", "url": "http://j/v1", "template": "{response}"}
        with pytest.raises(ValidationError) as caught:
            ScorerSettings(sources=[{**entry, **fields}])
        return str(caught.value)

    assert "address: the generator backend needs host:port" in problems(backend="generator", url=None)
    assert "template: must contain {response}" in problems(template="{prompt}")
    assert "template: unknown field {respnse}" in problems(template="{response} {respnse}")
    assert "verdict.pattern" in problems(verdict={"kind": "regex"})
    assert "verdict.field" in problems(verdict={"kind": "json"})
    assert "yes_no needs" in problems(backend="generator", address="g:1", verdict={"kind": "yes_no"})
    assert "score_range" in problems(score_range=[1, 1])
    assert "budget.requests_per_minute" in problems(budget={"requests_per_minute": 0}).replace(".judge", "")
    assert "cache.redis_url" in problems(cache={"redis_url": "http://x"}).replace(".judge", "")


async def test_guide_a_hung_judge_counts_even_when_the_deadline_leaves_no_time_for_its_retry():
    # "timeouts ... count": a try that timed out at the Score deadline's cap is a failed call, though the deadline
    # leaves no time for the retry `max_attempts: 2` would make (that retry is not sent)
    gateway = CallGuard("judge-hung", BudgetConfig(), BreakerConfig(failure_threshold=1, open_s=60))
    deadline, tries = Deadline.from_remaining(0.6), []

    async def hung(timeout: float) -> None:  # the try's own timeout: timeout_s capped by the deadline
        tries.append(timeout)
        await asyncio.sleep(timeout)  # the judge never answers within it
        raise SourceUnavailable(f"no answer within {timeout:.2f} s")

    with pytest.raises(SourceUnavailable, match="no answer within"):
        await gateway.call(hung, tokens=1, deadline=deadline, timeout_s=60.0, max_attempts=2, backoff_initial_s=0.001,
                           backoff_max_s=0.001)
    assert len(tries) == 1 and gateway.breaker.state.status is BreakerStatus.OPEN


async def test_guide_a_call_whose_backoff_would_outlast_the_deadline_fails_in_time_and_counts():
    # "the Score request's deadline is the limit" and a failed call counts once, after its retries: a backoff drawn
    # after a failed try that would end past the deadline is cut, and the call fails as its last try did, before the
    # deadline (the caller got DEADLINE_EXCEEDED, with no items named, and the breaker never counted it)
    gateway = CallGuard("judge-backoff", BudgetConfig(), BreakerConfig(failure_threshold=1, open_s=60))
    deadline, tries = Deadline.from_remaining(1.0), []

    async def down(timeout_s: float) -> None:
        tries.append(timeout_s)
        raise SourceUnavailable("HTTP 500")

    with pytest.raises(SourceUnavailable, match="HTTP 500") as failure:
        await gateway.call(down, tokens=1, deadline=deadline, timeout_s=60.0, max_attempts=2, backoff_initial_s=5.0,
                           backoff_max_s=5.0)
    assert len(tries) == 1 and deadline.remaining() > 0
    assert gateway.breaker.state.status is BreakerStatus.OPEN
    assert after_tries(failure.value) == "after 1 try"  # what the item's error says: the tries sent, not allowed


def test_guide_open_items_fail_at_once_for_open_s_whatever_an_earlier_call_answers():
    # "for `open_s` seconds the source's items fail at once": a call admitted before the breaker opened and
    # answering after does not close it
    config = BreakerConfig(failure_threshold=1, open_s=30)
    call, state = admit(BreakerState(), 0.0, config)
    earlier, state = admit(state, 0.0, config)
    opened = failed(state, call, 0.0, config, "HTTP 503")
    assert succeeded(opened, earlier) == opened and admit(succeeded(opened, earlier), 1.0, config)[0] is None


async def test_guide_a_call_queued_past_its_deadline_fails_naming_the_budget_before_the_deadline():
    # "A call still queued when that deadline passes fails its items naming the budget": it gives up a margin
    # before the deadline, so the caller hears it before its own RPC is cancelled
    budget = Budget("judge-queue", BudgetConfig(max_concurrency=1))
    held, release = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with budget.slot(1, Deadline()):
            held.set()
            await release.wait()

    task = asyncio.create_task(holder())
    await held.wait()
    deadline = Deadline.from_remaining(1.0)
    with pytest.raises(BudgetTimeout, match="queued for the budget .max_concurrency 1"):
        async with budget.slot(1, deadline):
            pass
    assert deadline.remaining() > 0  # before the deadline
    release.set()
    await task

"""services.generator.vllm_requests.sampled_version: the policy version read from vLLM's weight labels of a
finished output's tokens (records shaped as vLLM 0.32's ``RequestOutput``/``WeightVersionSpan``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from services.generator.vllm_requests import sampled_version


def _output(spans, tokens=(5, 6, 7)):
    completion = SimpleNamespace(token_ids=list(tokens), weight_versions=spans)
    return SimpleNamespace(request_id="r-0-0", outputs=[completion])


def _span(version: str, start: int, end: int):
    from vllm.outputs import WeightVersionSpan

    return WeightVersionSpan(version, start, end)


@pytest.mark.parametrize(("labels", "version"), [(["default"], 0), (["3"], 3), (["default", "0"], 0)])
def test_one_version_is_the_records(labels, version):
    spans = [_span(label, i, i + 1) for i, label in enumerate(labels)]
    assert sampled_version(_output(spans), expected=9) == version


def test_no_token_sampled_keeps_the_version_at_arrival():
    assert sampled_version(_output([], tokens=()), expected=4) == 4


def test_tokens_from_two_versions_carry_the_older_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="services.generator.vllm_requests"):
        assert sampled_version(_output([_span("2", 0, 1), _span("3", 1, 3)]), expected=2) == 2
    assert "sampled by policy versions [2, 3]" in caplog.text


def test_unlabelled_tokens_keep_the_version_at_arrival_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="services.generator.vllm_requests"):
        assert sampled_version(_output(None), expected=1) == 1
    assert "labelled none of its tokens" in caplog.text

"""Pure functions of a judge: its prompt from a template, and its answer to a reward.

:func:`render` fills ``{prompt}``, ``{response}``, ``{reference}``, ``{label}`` (other braces stay as written).
:func:`parse_verdict` reads a raw score from the answer's text (``boxed``, ``regex``, ``json``) or from its first
token's log-probs (``yes_no``); :func:`to_reward` checks it against ``score_range`` and maps it linearly onto
``reward_range``. Garbage (no verdict, not a number, NaN, out of range) is a :class:`Verdict` with an error that
quotes the answer, never a number.

Yes/no probability: with log-probs ``lp`` of the first answer token's candidates (an OpenAI-compatible endpoint's
``top_logprobs``), ``P(yes) = Σ exp(lp)`` over ``yes_tokens`` and ``P(no)`` likewise (a side absent from the
candidates counts 0); the score is ``P(yes) / (P(yes) + P(no))`` in [0, 1].
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from services.scorer.judges.config import TEMPLATE_FIELDS, VerdictConfig

_FIELD = re.compile(r"\{(" + "|".join(TEMPLATE_FIELDS) + r")\}")
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(%|/\s*([-+]?\d+\.?\d*))?\s*$")
_QUOTE = 160  # characters of the answer quoted in an error


@dataclass(frozen=True)
class Verdict:
    """A judge's raw score, or why there is none (``error`` quotes the answer)."""

    score: float | None
    error: str | None = None


def render(template: str, fields: Mapping[str, str]) -> str:
    """``template`` with each ``{field}`` of :data:`TEMPLATE_FIELDS` replaced by ``fields[field]`` ('' if absent)."""
    return _FIELD.sub(lambda match: fields.get(match.group(1), ""), template)


def parse_number(text: str) -> float | None:
    """A number written plainly: ``7``, ``-0.5``, ``1e-3``, ``80%`` (0.8), ``3/4`` (0.75); else None."""
    match = _NUMBER.match(text.replace("\\%", "%"))
    if match is None:
        return None
    value = float(match.group(1))
    if match.group(2) == "%":
        return value / 100
    if match.group(3) is not None:
        denominator = float(match.group(3))
        return value / denominator if denominator else None
    return value


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def json_field(text: str, path: str) -> object | None:
    """``path`` (dotted) in the last JSON object of ``text`` that has it (fenced code blocks included), or None."""
    decoder = json.JSONDecoder()
    found = None
    for start in (i for i, char in enumerate(text) if char == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            found = value
    return found


def yes_probability(logprobs: Mapping[str, float], yes: tuple[str, ...], no: tuple[str, ...]) -> float | None:
    """P(yes) / (P(yes) + P(no)) from one token's candidates' log-probs (module docs); None when neither appears."""
    probs: dict[str, float] = {}
    for token, logprob in logprobs.items():
        if math.isfinite(logprob):
            probs[token.strip()] = probs.get(token.strip(), 0.0) + math.exp(logprob)
    p_yes = sum(probs.get(token, 0.0) for token in set(yes))
    p_no = sum(probs.get(token, 0.0) for token in set(no))
    if p_yes == 0 and p_no == 0:
        return None
    return p_yes / (p_yes + p_no)


def _quoted(text: str) -> str:
    return repr(text if len(text) <= _QUOTE else text[: _QUOTE // 2] + " ... " + text[-_QUOTE // 2 :])


def parse_verdict(text: str, spec: VerdictConfig, logprobs: Mapping[str, float] | None = None) -> Verdict:
    """The raw score in a judge's answer ``text`` (``logprobs``: its first token's candidates, for ``yes_no``)."""
    if spec.kind == "yes_no":
        if logprobs is None:
            return Verdict(None, "yes_no verdict: the backend returned no log-probs")
        score = yes_probability(logprobs, spec.yes_tokens, spec.no_tokens)
        if score is None:
            return Verdict(None, f"yes_no verdict: first token neither yes nor no (answer {_quoted(text)})")
        return Verdict(score)
    if spec.kind == "boxed":
        raw = last_boxed(text)
        where = "no \\boxed{} in the answer"
    elif spec.kind == "regex":
        match = re.search(spec.pattern or "", text)
        raw = None if match is None else (match.group(1) if match.groups() else match.group(0))
        where = f"no match of {spec.pattern!r}"
    else:
        value = json_field(text, spec.field or "")
        raw = str(float(value)) if isinstance(value, bool | int | float) else value if isinstance(value, str) else None
        where = f"no JSON object with a number at {spec.field!r}"
    if raw is None:
        return Verdict(None, f"{spec.kind} verdict: {where} (answer {_quoted(text)})")
    score = parse_number(raw)
    if score is None or not math.isfinite(score):
        return Verdict(None, f"{spec.kind} verdict: {raw.strip()[:40]!r} is not a number (answer {_quoted(text)})")
    return Verdict(score)


def to_reward(score: float, score_range: tuple[float, float], reward_range: tuple[float, float]) -> float | None:
    """``score`` mapped linearly from ``score_range`` onto ``reward_range``; None when outside ``score_range``."""
    low, high = score_range
    if not low <= score <= high:
        return None
    out_low, out_high = reward_range
    return out_low + (score - low) / (high - low) * (out_high - out_low)

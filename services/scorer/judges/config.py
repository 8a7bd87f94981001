"""A judge source as a reward team configures it (``type: judge`` in the scorer's ``sources``); records only.

Example (YAML, a scorer's ``sources`` entry)::

    - type: judge
      name: helpful
      backend: openai                 # or generator (a fastexp generator's Generate; `address: host:port`)
      url: http://judge:8000/v1       # any OpenAI-compatible chat endpoint, e.g. `vllm serve`
      model: Qwen/Qwen3-8B
      template: |
        Question: {prompt}
        Answer: {response}
        Reference: {reference}
        Rate the answer from 0 to 10; end with \\boxed{score}.
      verdict: {kind: boxed}
      score_range: [0, 10]
      reward_range: [0, 1]

See docs/reward-teams/judges.md for verdict kinds, budgets, breakers and the cache.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.scorer.outbound.config import BreakerConfig, BudgetConfig, CacheConfig

#: The fields a template may name, each written ``{field}``; other braces are kept as written (``\boxed{}``).
TEMPLATE_FIELDS = ("prompt", "response", "reference", "label")


class VerdictConfig(BaseModel):
    """How a judge's answer becomes a number (:mod:`services.scorer.judges.verdicts`):

    - ``boxed``: the number in the last ``\\boxed{...}`` (``7``, ``-0.5``, ``3/4``, ``80%``);
    - ``regex``: ``pattern``'s first group (or whole match), first match in the answer;
    - ``json``: the dotted ``field`` of the last JSON object in the answer (a number, a numeric string, or a
      boolean as 1/0);
    - ``yes_no``: P(yes) / (P(yes) + P(no)) over the first answer token's log-probs (``yes_tokens``,
      ``no_tokens``); needs candidates' log-probs, which the openai backend asks for (``top_logprobs``) and a
      fastexp generator does not return (it gives only the sampled token's). Its raw score is in [0, 1].
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["boxed", "regex", "json", "yes_no"] = "boxed"
    pattern: str | None = Field(None, description="regex verdicts: a Python regex, its first group the score")
    field: str | None = Field(None, description="json verdicts: dotted path of the score, e.g. 'score' or 'a.b'")
    yes_tokens: tuple[str, ...] = Field(("yes", "Yes", "YES"), description="yes_no: tokens meaning yes (stripped)")
    no_tokens: tuple[str, ...] = Field(("no", "No", "NO"), description="yes_no: tokens meaning no (stripped)")

    @model_validator(mode="after")
    def _complete(self) -> Self:
        if self.kind == "regex":
            if not self.pattern:
                raise ValueError("verdict.pattern: a regex verdict needs a pattern")
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"verdict.pattern: not a regex ({error})") from error
        if self.kind == "json" and not self.field:
            raise ValueError("verdict.field: a json verdict needs the field holding the score")
        return self


class JudgeConfig(BaseModel):
    """An LLM judge (module docs). Its items are sent in calls of ``batch_size`` prompts (generator: one
    ``Generate`` per call; openai: one chat request per prompt, ``budget.max_concurrency`` at once), each call with
    a deadline of ``timeout_s`` capped by the request's; timeouts, connection errors and 5xx are retried up to
    ``max_attempts`` tries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["judge"] = "judge"
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="source name: metric prefix and recipe key")
    fallback_reward: float | None = Field(None, description="reward of an item the judge failed on; None: it fails")
    backend: Literal["generator", "openai"] = Field(description="a fastexp generator, or an OpenAI-compatible API")
    address: str | None = Field(None, description="generator backend: host:port of its GenerationService")
    url: str | None = Field(None, pattern=r"^https?://", description="openai backend: base URL, e.g. http://j:8000/v1")
    model: str = Field("", description="openai backend: the served model's name")
    headers: dict[str, str] = Field(default_factory=dict, description="openai backend: extra HTTP headers")
    token_file: Path | None = Field(
        None, description="a file holding the judge's bearer token: a generator's auth token, or the API's key "
        "(sent as 'Authorization: Bearer'; read at start-up, never logged)",
    )
    tls_ca_file: Path | None = Field(
        None, description="CA bundle that signed the judge's certificate (generator: TLS on; openai: verify "
        "https with it instead of the system's)",
    )
    apply_chat_template: bool = Field(
        True, description="generator backend: wrap system + template in the model's chat template (its tokenizer)"
    )
    system: str = Field("", description="system message ('' for none)")
    template: str = Field(description="the judge's user message; {prompt}, {response}, {reference}, {label}")
    verdict: VerdictConfig = Field(default_factory=VerdictConfig)
    score_range: tuple[float, float] = Field((0.0, 1.0), description="valid verdicts; one outside fails its item")
    reward_range: tuple[float, float] = Field((0.0, 1.0), description="score_range maps linearly onto this")
    max_new_tokens: int = Field(256, ge=1, description="answer tokens per judgement (yes_no: 1)")
    temperature: float = Field(0.0, ge=0, description="judge sampling temperature (0: greedy)")
    batch_size: int = Field(32, ge=1, description="generator backend: prompts per Generate call")
    timeout_s: float = Field(60.0, gt=0, description="deadline of one call, capped by the request's")
    max_response_bytes: int = Field(
        1024 * 1024, ge=1024, description="largest answer of one call (openai backend); a bigger one is refused, "
        "unread past the cap, and its items fail naming it",
    )
    max_attempts: int = Field(2, ge=1, description="tries per call on timeouts, connection errors, 5xx and 429")
    backoff_initial_s: float = Field(0.5, gt=0, description="first retry wait; doubles per retry, with jitter")
    backoff_max_s: float = Field(8.0, gt=0, description="cap of one retry wait")
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)

    @property
    def recipe_type(self) -> str:
        """Judges are named as ``("model", name, weight)`` in recipes, like the other reward models."""
        return "model"

    @property
    def answer_tokens(self) -> int:
        """Tokens a judgement may sample: 1 for yes/no verdicts, else ``max_new_tokens``."""
        return 1 if self.verdict.kind == "yes_no" else self.max_new_tokens

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        problems = []
        if self.backend == "generator" and not self.address:
            problems.append("address: the generator backend needs host:port")
        if self.backend == "openai" and not self.url:
            problems.append("url: the openai backend needs the endpoint's base URL")
        if self.verdict.kind == "yes_no" and self.backend != "openai":
            problems.append("verdict.kind: yes_no needs the candidates' log-probs of the openai backend (a generator "
                            "returns only the sampled token's); use boxed, regex or json")
        if "{response}" not in self.template:
            problems.append("template: must contain {response}")
        # a {word} not right after a letter (as in \boxed{score}) is meant as a field: catch typos
        for name in re.findall(r"(?<![A-Za-z])\{([a-z_]+)\}", self.template):
            if name not in TEMPLATE_FIELDS:
                problems.append(f"template: unknown field {{{name}}} (fields: {', '.join(TEMPLATE_FIELDS)})")
        low, high = self.score_range
        if not low < high:
            problems.append(f"score_range: [{low}, {high}] must have low < high")
        if problems:
            raise ValueError("; ".join(problems))
        return self

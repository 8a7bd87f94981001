"""Agent episodes: one call of an operator-run agent server per sample, its model calls recorded by the gateway.

For each episode the runner opens a gateway session (a random key that expires with the episode) and POSTs the
agent server, named by the request from the operator's map (``agents`` in the experience settings; a request never
carries a URL), with a deadline::

    POST <url>  {"episode_id": str, "messages": [...] (the prompt), "prompt": str, "reference": str, "label": str,
                 "session": {"base_url": str, "api_key": str, "model": str}}
    -> 200 {"reward": float | null, "metrics": {name: float}}

The agent calls ``base_url`` with ``api_key`` (any OpenAI client); when it answers, the session is closed and its
calls become rows (:func:`~services.experience.gateway.recording.rows_of`): token-exact, ``action_mask`` 1 on the
sampled ids only, split where the agent's framework rewrote history (metrics ``num_rows``, ``drift_splits``). A
``null`` reward leaves it to the scorer (its recipes score the episode's last reply). An agent that fails, times out
or answers something else fails its episode (:class:`EpisodeFailed`: its group only).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from services.common.bodies import ACCEPT_ENCODING, ReplyTooLarge, read_capped
from services.common.deadlines import Deadline
from services.common.errors import EpisodeFailed, InvalidRequest
from services.common.generation import CompletionRecord
from services.experience.gateway.recording import Row, rows_of
from services.experience.gateway.sessions import SessionRegistry
from services.experience.pipeline.events import AgentEpisode

#: Largest answer read from an agent server (its reward and metrics, JSON): a longer one fails its episode unread.
MAX_ANSWER_BYTES = 1024 * 1024


@dataclass(frozen=True)
class AgentServer:
    """One entry of the operator's map: the agent's URL and the deadline of one episode (seconds)."""

    url: str
    timeout_s: float


def row_record(row: Row, prompt_index: int, sample_index: int, text: str) -> CompletionRecord:
    """A :class:`Row` as the pipeline's multi-turn record (``action_mask`` 1 on sampled ids, log-probs 0 elsewhere;
    ``policy_version`` the oldest of its sampled turns)."""
    ids = [t for s in row.segments for t in s.token_ids]
    mask = [int(s.sampled) for s in row.segments for _ in s.token_ids]
    log_probs = [p for s in row.segments for p in s.log_probs]
    versions = [s.policy_version for s in row.segments if s.sampled and s.policy_version is not None]
    return CompletionRecord(
        prompt_index=prompt_index, sample_index=sample_index, prompt_token_ids=row.prompt_ids,
        output_token_ids=tuple(ids), output_log_probs=np.asarray(log_probs, dtype=np.float32),
        finish_reason="stop" if row.finish_reason == "stop" else "length", text=text,
        policy_version=min(versions, default=0), action_mask=tuple(mask), num_turns=row.num_turns,
    )


def _outcome(payload: Any, name: str) -> tuple[float | None, dict[str, float]]:
    """The agent's answer as (reward, metrics); reward None when the agent leaves it to the scorer.

    Raises:
        EpisodeFailed: not ``{"reward": number | null, "metrics": {name: number}}``.
    """
    if not isinstance(payload, Mapping):
        raise EpisodeFailed(f"agent {name!r}: the answer is not a JSON object")
    reward, metrics = payload.get("reward"), payload.get("metrics") or {}
    if reward is None:
        pass
    elif isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EpisodeFailed(f"agent {name!r}: 'reward' must be a finite number")
    if not isinstance(metrics, Mapping) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()):
        raise EpisodeFailed(f"agent {name!r}: 'metrics' must map names to numbers")
    return (None if reward is None else float(reward)), {str(k): float(v) for k, v in metrics.items()}


class AgentRunner:
    """Runs agent episodes against the operator's agent servers through the gateway (module docs)."""

    def __init__(self, agents: Mapping[str, AgentServer], sessions: SessionRegistry, base_url: str, model: str,
                 tokenizer: Any, client: httpx.AsyncClient | None = None) -> None:
        """``base_url``: the gateway's ``/v1`` as agents reach it; ``model``: the model name sessions serve."""
        self._agents = dict(agents)
        self._model = model
        self._sessions = sessions
        self._base_url = base_url
        self._tokenizer = tokenizer
        self._client = client or httpx.AsyncClient(follow_redirects=False)

    def check(self, name: str) -> None:
        """Raises :class:`InvalidRequest` (``agent.name``) for a name the operator did not configure."""
        if name not in self._agents:
            raise InvalidRequest("agent.name", f"no agent {name!r} here (configured: {sorted(self._agents)})")

    async def run_episode(
        self, name: str, messages: Sequence[Mapping[str, str]], prompt: str, reference: str, label: str,
        prompt_index: int, sample_index: int, deadline: Deadline, max_calls: int | None = None,
    ) -> AgentEpisode:
        """One episode (module docs); the session is closed however it ends.

        Raises:
            InvalidRequest: ``name`` is not configured.
            EpisodeFailed: the agent failed, timed out, answered badly, or made no model call.
            UpstreamTimeout: the request's deadline has passed.
        """
        self.check(name)
        agent = self._agents[name]
        timeout = deadline.timeout(agent.timeout_s)
        model = self._model
        session = self._sessions.open(model, timeout, max_calls)
        body = {"episode_id": session.name, "messages": list(messages), "prompt": prompt, "reference": reference,
                "label": label, "session": {"base_url": self._base_url, "api_key": session.key, "model": model}}
        try:
            async with self._client.stream("POST", agent.url, json=body, timeout=timeout,
                                           headers={"Accept-Encoding": ACCEPT_ENCODING}) as response:
                if response.status_code != 200:
                    raise EpisodeFailed(f"agent {name!r}: HTTP {response.status_code}")
                answer = await read_capped(response, MAX_ANSWER_BYTES, "the agent answer cap")
            reward, metrics = _outcome(json.loads(answer), name)
        except httpx.TimeoutException as error:
            raise EpisodeFailed(f"agent {name!r}: no answer within {timeout:.1f} s") from error
        except (httpx.HTTPError, ValueError, ReplyTooLarge) as error:
            raise EpisodeFailed(f"agent {name!r}: {type(error).__name__}: {error}") from error
        finally:
            calls = self._sessions.close(session)
        rows = rows_of(calls)
        if not rows:
            raise EpisodeFailed(f"agent {name!r}: the episode made no model call")
        records = tuple(
            row_record(row, prompt_index, sample_index, self._tokenizer.decode(
                [t for s in row.segments for t in s.token_ids], skip_special_tokens=False))
            for row in rows
        )
        final = calls[-1].choices[0].reply.content if calls[-1].choices else ""
        return AgentEpisode(records, reward, {**metrics, "num_rows": float(len(rows)),
                                              "drift_splits": float(session.drifts), "num_calls": float(len(calls))},
                            final)

    async def close(self) -> None:
        await self._client.aclose()

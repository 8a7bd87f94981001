"""Which generator replica gets a prompt group: least outstanding work, with prefix affinity where it pays.

Pure functions over plain records, used by :class:`~services.experience.fleet.generator_fleet.GeneratorFleet`. A prompt group goes
whole to one replica: its n samples share the prompt's KV cache there (vLLM's prefix caching), so splitting it
would pay the prefill n times over.

The cost of sending group g to replica r is what r has outstanding plus what g adds there::

    cost(r, g) = outstanding_tokens(r) + decode_tokens(g) + (0 if r is warm for g else prompt_tokens(g))

``outstanding_tokens``: tokens r's unfinished samples may still process (each reserves its prompt once per group
and ``max_tokens`` per sample); ``warm``: r served a group with the same prompt recently, so its prefill is a
prefix-cache hit (resampled groups, a prompt sent again by the next step). The replica of least cost wins; ties go
to the smaller outstanding work, then to the name (deterministic). So affinity breaks near-ties, worth at most
the prefill it saves, and never sends work to a replica that is busier by more than that (sglang-router's
cache-aware policy, with its balance threshold set to one prompt's prefill).

With a cap on the samples a replica runs at once (``max_samples_in_flight``, the engine's batch capacity), a group
goes only to a replica with room for its n samples (or to an idle one, whatever n), and waits otherwise: groups
are then placed as replicas free up, which keeps every replica busy to the end of a round instead of fixing the
split up front (a replica that drew the long answers would finish last while the other idles).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupWork:
    """One prompt group's work estimate (tokens) and its affinity key."""

    prefix_key: str  # equal for groups with the same prompt tokens (see prefix_key)
    prompt_tokens: int
    decode_tokens: int  # n_samples_per_prompt * max_tokens: the most its samples can generate

    @property
    def tokens(self) -> int:
        """The group's work on a cold replica (prefill once, then every sample's budget)."""
        return self.prompt_tokens + self.decode_tokens


def prefix_key(token_ids: Sequence[int]) -> str:
    """The affinity key of a prompt: a digest of its token ids (16 hex characters of BLAKE2b)."""
    return hashlib.blake2b(repr(tuple(token_ids)).encode(), digest_size=8).hexdigest()


def group_work(token_ids: Sequence[int], n_samples_per_prompt: int, max_tokens: int) -> GroupWork:
    """The work of generating ``n_samples_per_prompt`` samples of up to ``max_tokens`` each for one prompt."""
    return GroupWork(prefix_key(token_ids), len(token_ids), n_samples_per_prompt * max_tokens)


def choose_replica(outstanding: Mapping[str, int], group: GroupWork, warm: Collection[str] = ()) -> str:
    """The replica (by name) of least cost for ``group`` (module docs); ``warm``: replicas holding its prompt.

    Raises:
        ValueError: ``outstanding`` is empty (no replica to choose from).
    """
    if not outstanding:
        raise ValueError("no replica to route to")

    def rank(name: str) -> tuple[int, int, str]:
        cost = outstanding[name] + group.decode_tokens + (0 if name in warm else group.prompt_tokens)
        return cost, outstanding[name], name

    return min(outstanding, key=rank)


def assign_groups(
    outstanding: Mapping[str, int],
    groups: Sequence[GroupWork],
    warm: Callable[[GroupWork], Collection[str]] = lambda group: (),
) -> list[str]:
    """A replica for each of ``groups``, in order, each choice counting the work of the ones before it (and
    making its replica warm for that prompt): :func:`place_groups` without a cap.

    Raises:
        ValueError: ``outstanding`` is empty.
    """
    if not outstanding:
        raise ValueError("no replica to route to")
    chosen = place_groups(outstanding, dict.fromkeys(outstanding, 0), groups, 1, None, warm)
    return [name for name in chosen if name is not None]


def place_groups(
    outstanding: Mapping[str, int],
    in_flight: Mapping[str, int],
    groups: Sequence[GroupWork],
    samples_per_group: int,
    max_samples_in_flight: int | None,
    warm: Callable[[GroupWork], Collection[str]] = lambda group: (),
) -> list[str | None]:
    """A replica for each of ``groups`` in order, or ``None`` for a group no replica has room for now.

    ``outstanding``: each replica's outstanding tokens; ``in_flight``: the samples it runs now. A replica has room
    for a group while ``in_flight + samples_per_group <= max_samples_in_flight`` (``None``: always), or when idle.
    Each placement counts toward the next ones (work, samples, and warmth for its prompt).
    """
    load, running = dict(outstanding), dict(in_flight)
    placed: dict[str, set[str]] = {}  # prefix key -> replicas given that prompt here
    chosen: list[str | None] = []
    for group in groups:
        roomy = {
            name: load[name] for name in load
            if max_samples_in_flight is None or running[name] == 0
            or running[name] + samples_per_group <= max_samples_in_flight
        }
        if not roomy:
            chosen.append(None)
            continue
        holders = set(warm(group)) | placed.get(group.prefix_key, set())
        name = choose_replica(roomy, group, holders)
        load[name] += group.decode_tokens + (0 if name in holders else group.prompt_tokens)
        running[name] += samples_per_group
        placed.setdefault(group.prefix_key, set()).add(name)
        chosen.append(name)
    return chosen

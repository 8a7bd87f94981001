"""The state store's rows as frozen records, and the transactions over them: each function takes an open
:class:`~sqlalchemy.engine.Connection` inside :meth:`StateStore.transact` and does one thing to one entity, its
checks and its write together (so two replicas cannot both pass a check and both write).

One record per run (:class:`RunRow`): owner, adapter, limits, its adapter's live version and weights, an update in
progress, and its running statistics. The deployment's models (``policy``, ``critic``) are :class:`ModelRow`.
Versions are issued here, once: an update claims its row (:func:`claim_update`, serialized by the row lock), and
its commit (:func:`commit_update`) makes the version live, only if the claim is still its own.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from fastexp.errors import AlreadyExists, FailedPrecondition, NotFound, Overloaded
from services.common.lora import AdapterConfig
from services.common.versions import Claim, Live, Snapshot
from services.experience.state.schema import models, replicas, runs, scoped_statistics, stream_slots

#: The deployment's model targets (rows of ``models``).
MODEL_TARGETS = ("policy", "critic")


@dataclass(frozen=True)
class Statistics:
    """A run's running statistics: reward moments (count, mean, M2: :class:`fastexp.rl.running.RunningMoments`)
    and the adaptive KL controller's beta (None: never adapted, the request's ``kl_coef`` applies)."""

    reward_count: int = 0
    reward_mean: float = 0.0
    reward_m2: float = 0.0
    kl_coef: float | None = None


@dataclass(frozen=True)
class RunRow:
    """One run's row. ``lora``: (rank, alpha, sorted target modules), None for a base-model run; ``limits``:
    (max_streams, max_groups_ahead, max_tokens_per_request, weight)."""

    run_id: str
    owner: str
    created_at_unix_s: float
    lora: tuple[int, float, tuple[str, ...]] | None
    limits: tuple[int, int, int, int]
    live: Live = Live()
    statistics: Statistics = Statistics()


# --- runs ---------------------------------------------------------------------------------------------------

def _run_row(row: sa.Row, now: float) -> RunRow:
    lora = None
    if row.lora_rank is not None:
        lora = (row.lora_rank, row.lora_alpha, tuple(json.loads(row.lora_target_modules)))
    updating = row.update_claim is not None and (row.update_claim_until_unix_s or 0.0) > now
    return RunRow(
        row.run_id, row.owner, row.created_at_unix_s, lora,
        (row.max_streams, row.max_groups_ahead, row.max_tokens_per_request, row.weight),
        Live(row.policy_version, row.weights_digest, updating),
        Statistics(row.reward_count, row.reward_mean, row.reward_m2, row.kl_coef),
    )


def insert_run(connection: Connection, row: RunRow, max_runs: int) -> RunRow:
    """Create the run ``row`` describes (version 0, no statistics).

    Raises:
        AlreadyExists: naming ``run_id``. Overloaded: naming ``max_runs`` (that many runs exist).
    """
    if connection.execute(sa.select(runs.c.run_id).where(runs.c.run_id == row.run_id)).first() is not None:
        raise AlreadyExists(f"run_id: a run {row.run_id!r} exists already")
    count = connection.execute(sa.select(sa.func.count()).select_from(runs)).scalar_one()
    if count >= max_runs:
        raise Overloaded(f"max_runs: this deployment holds {count} runs, as many as its operator allows; "
                         "delete one first")
    rank, alpha, modules = row.lora if row.lora is not None else (None, None, None)
    max_streams, max_groups_ahead, max_tokens, weight = row.limits
    connection.execute(runs.insert().values(
        run_id=row.run_id, owner=row.owner, created_at_unix_s=row.created_at_unix_s, lora_rank=rank,
        lora_alpha=alpha, lora_target_modules=None if modules is None else json.dumps(sorted(modules)),
        max_streams=max_streams, max_groups_ahead=max_groups_ahead, max_tokens_per_request=max_tokens,
        weight=weight, policy_version=0, reward_count=0, reward_mean=0.0, reward_m2=0.0, revision=1,
    ))
    return row


def select_run(connection: Connection, run_id: str, now: float, lock: bool = False) -> RunRow | None:
    """The run ``run_id``, or None; ``lock``: hold its row until the transaction ends (PostgreSQL)."""
    query = sa.select(runs).where(runs.c.run_id == run_id)
    row = connection.execute(query.with_for_update() if lock else query).first()
    return None if row is None else _run_row(row, now)


def select_runs(connection: Connection, now: float) -> list[RunRow]:
    """Every run, by run id."""
    return [_run_row(row, now) for row in connection.execute(sa.select(runs).order_by(runs.c.run_id))]


def delete_run(connection: Connection, run_id: str) -> None:
    """Remove the run's row: its owner, adapter, versions, statistics; and its (dead replicas') stream slots."""
    connection.execute(stream_slots.delete().where(stream_slots.c.run_id == run_id))
    connection.execute(runs.delete().where(runs.c.run_id == run_id))


# --- stream slots and replicas ------------------------------------------------------------------------------

def _alive_replicas(alive_after: float) -> sa.Select:
    return sa.select(replicas.c.replica_id).where(replicas.c.heartbeat_unix_s > alive_after)


def count_streams(connection: Connection, alive_after: float) -> dict[str, int]:
    """Open streams per run id, on replicas heard from after ``alive_after``."""
    query = (sa.select(stream_slots.c.run_id, sa.func.count())
             .where(stream_slots.c.replica_id.in_(_alive_replicas(alive_after)))
             .group_by(stream_slots.c.run_id))
    return {run_id: count for run_id, count in connection.execute(query)}


def open_slot(connection: Connection, run_id: str, replica_id: str, now: float, alive_after: float,
              stream_key: str | None = None, take_over: bool = False) -> str:
    """Take one of the run's stream slots (the run's row locked: two replicas cannot both take the last one);
    returns the slot's id. A resumable stream's slot records its ``stream_key``; its resume (``take_over``) first
    takes back the slots of its earlier opens (a killed replica's would count until ``replica_ttl_s``, refusing the
    resume at ``max_streams``; an earlier open still running ends at its next batch: it was superseded).

    Raises:
        NotFound: the run was deleted meanwhile. Overloaded: naming ``max_streams``.
    """
    run = select_run(connection, run_id, now, lock=True)
    if run is None:
        raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
    if stream_key is not None and take_over:
        connection.execute(stream_slots.delete().where(stream_slots.c.stream_key == stream_key))
    open_now = count_streams(connection, alive_after).get(run_id, 0)
    if open_now >= run.limits[0]:
        raise Overloaded(f"max_streams: run {run_id!r} has {open_now} MakeExperiences streams open, its "
                         "max_streams; retry when one ends")
    slot_id = uuid.uuid4().hex
    connection.execute(stream_slots.insert().values(slot_id=slot_id, run_id=run_id, replica_id=replica_id,
                                                    opened_at_unix_s=now, stream_key=stream_key))
    return slot_id


def close_slot(connection: Connection, slot_id: str) -> None:
    """Give a stream slot back."""
    connection.execute(stream_slots.delete().where(stream_slots.c.slot_id == slot_id))


def heartbeat(connection: Connection, replica_id: str, address: str, now: float, dead_before: float) -> None:
    """Say replica ``replica_id`` is alive at ``now``; forget replicas silent since ``dead_before`` and their
    stream slots (killed replicas' streams no longer hold their runs' slots)."""
    updated = connection.execute(replicas.update().where(replicas.c.replica_id == replica_id)
                                 .values(heartbeat_unix_s=now, address=address)).rowcount
    if not updated:
        connection.execute(replicas.insert().values(replica_id=replica_id, address=address, heartbeat_unix_s=now))
    dead = sa.select(replicas.c.replica_id).where(replicas.c.heartbeat_unix_s <= dead_before)
    connection.execute(stream_slots.delete().where(stream_slots.c.replica_id.in_(dead)))
    connection.execute(replicas.delete().where(replicas.c.heartbeat_unix_s <= dead_before))


def leave(connection: Connection, replica_id: str) -> None:
    """A replica stopping: its row and stream slots go."""
    connection.execute(stream_slots.delete().where(stream_slots.c.replica_id == replica_id))
    connection.execute(replicas.delete().where(replicas.c.replica_id == replica_id))


# --- versions: claims and commits ---------------------------------------------------------------------------

def select_model(connection: Connection, target: str, now: float, lock: bool = False) -> Live:
    """The deployment model ``target``'s live version (``policy`` or ``critic``)."""
    query = sa.select(models).where(models.c.target == target)
    row = connection.execute(query.with_for_update() if lock else query).one()
    updating = row.update_claim is not None and (row.update_claim_until_unix_s or 0.0) > now
    return Live(row.version, row.weights_digest, updating)


def select_live(connection: Connection, now: float) -> Snapshot:
    """Every live version at once: the deployment's models, and LoRA runs' adapters by run id."""
    lora_runs = [row for row in select_runs(connection, now) if row.lora is not None]
    return Snapshot(select_model(connection, "policy", now), select_model(connection, "critic", now),
                    {row.run_id: row.live for row in lora_runs},
                    {row.run_id: AdapterConfig(*row.lora) for row in lora_runs})


def claim_update(connection: Connection, now: float, until: float, *, target: str | None = None,
                 run_id: str | None = None) -> Claim:
    """Claim the right to update ``target`` (a deployment model) or run ``run_id``'s adapter until ``until``
    (an expired claim, its replica killed mid-update, is taken over).

    Raises:
        Overloaded: another update of it is in progress (naming ``run_id`` for a run). NotFound: no such run.
        FailedPrecondition: a base ``policy`` update while LoRA runs exist (their adapters sit on the base).
    """
    claim_id = uuid.uuid4().hex
    if run_id is not None:
        run = select_run(connection, run_id, now, lock=True)
        if run is None:
            raise NotFound(f"run_id: no run {run_id!r} here (never created, or deleted)")
        if run.live.updating:
            raise Overloaded(f"run_id: another update of run {run_id!r}'s adapter, or the deletion of a previous "
                             "run of that id, is in progress")
        connection.execute(runs.update().where(runs.c.run_id == run_id).values(
            update_claim=claim_id, update_claim_until_unix_s=until, revision=runs.c.revision + 1))
        return Claim(claim_id, run.live, run_id=run_id)
    assert target in MODEL_TARGETS, target
    live = select_model(connection, target, now, lock=True)
    if live.updating:
        raise Overloaded(f"another {target} weight update is in progress")
    if target == "policy":
        lora_runs = tuple(r for (r,) in connection.execute(
            sa.select(runs.c.run_id).where(runs.c.lora_rank.is_not(None)).order_by(runs.c.run_id)))
        if lora_runs:
            raise FailedPrecondition(
                f"header.target: LoRA runs {', '.join(lora_runs)} sample adapters over the base model; updating "
                "it would change their policies under them (delete them first)")
    connection.execute(models.update().where(models.c.target == target).values(
        update_claim=claim_id, update_claim_until_unix_s=until))
    return Claim(claim_id, live, target=target)


def commit_update(connection: Connection, claim: Claim, version: int | None, weights_digest: str | None,
                  now: float) -> bool:
    """End ``claim``: ``version`` (with its blob) live, or (``version`` None: the update failed) the live one
    kept. Returns False when the claim was no longer this update's (it expired and another took it): nothing is
    written then."""
    if claim.run_id is not None:
        table, where = runs, runs.c.run_id == claim.run_id
        values: dict = {"revision": runs.c.revision + 1}
        if version is not None:
            values |= {"policy_version": version, "weights_digest": weights_digest}
    else:
        table, where = models, models.c.target == claim.target
        values = {"updated_at_unix_s": now}
        if version is not None:
            values |= {"version": version, "weights_digest": weights_digest}
    result = connection.execute(table.update().where(where, table.c.update_claim == claim.claim_id).values(
        update_claim=None, update_claim_until_unix_s=None, **values))
    return result.rowcount == 1


def digests_in_use(connection: Connection) -> set[str]:
    """Every blob a live version names (what weight collection keeps)."""
    found = {d for (d,) in connection.execute(sa.select(models.c.weights_digest)) if d}
    found |= {d for (d,) in connection.execute(sa.select(runs.c.weights_digest)) if d}
    return found


# --- running statistics -------------------------------------------------------------------------------------

def select_statistics(connection: Connection, *, run_id: str, principal: str | None, lock: bool) -> Statistics:
    """The statistics of created run ``run_id`` (``principal`` None), or of the id ``run_id`` scoped to
    ``principal`` (no run of that id): zero when never written.

    Raises:
        NotFound: the created run is gone (deleted mid-stream).
    """
    if principal is None:
        row = select_run(connection, run_id, 0.0, lock=lock)
        if row is None:
            raise NotFound(f"run_id: run {run_id!r} was deleted while its stream ran")
        return row.statistics
    query = sa.select(scoped_statistics).where(scoped_statistics.c.principal == principal,
                                               scoped_statistics.c.run_id == run_id)
    row = connection.execute(query.with_for_update() if lock else query).first()
    if row is None:
        return Statistics()
    return Statistics(row.reward_count, row.reward_mean, row.reward_m2, row.kl_coef)


def write_statistics(connection: Connection, statistics: Statistics, now: float, *, run_id: str,
                     principal: str | None, keep: int) -> None:
    """Store ``statistics`` as the latest of the run (``principal`` None) or of the caller-scoped id; when a new
    caller-scoped id is written, such rows beyond the ``keep`` most recently written are removed (least recently
    written first; a stream's own, scope ``stream:<principal>``, go with the stream's record instead)."""
    values = {"reward_count": statistics.reward_count, "reward_mean": statistics.reward_mean,
              "reward_m2": statistics.reward_m2, "kl_coef": statistics.kl_coef}
    if principal is None:
        connection.execute(runs.update().where(runs.c.run_id == run_id).values(**values, revision=runs.c.revision + 1))
        return
    where = (scoped_statistics.c.principal == principal, scoped_statistics.c.run_id == run_id)
    if connection.execute(scoped_statistics.update().where(*where).values(**values, updated_at_unix_s=now)).rowcount:
        return
    connection.execute(scoped_statistics.insert().values(principal=principal, run_id=run_id, updated_at_unix_s=now,
                                                         **values))
    # a new key: the oldest of the callers' ids beyond ``keep`` go (streams' own go with their records instead)
    callers = ~scoped_statistics.c.principal.startswith("stream:")
    count = connection.execute(sa.select(sa.func.count()).select_from(scoped_statistics).where(callers)).scalar_one()
    if count > keep:
        oldest = (sa.select(scoped_statistics.c.updated_at_unix_s).where(callers)
                  .order_by(scoped_statistics.c.updated_at_unix_s).offset(count - keep - 1).limit(1)).scalar_subquery()
        connection.execute(scoped_statistics.delete().where(callers, scoped_statistics.c.updated_at_unix_s <= oldest))

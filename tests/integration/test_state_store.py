"""The experience tier's state store on its two real backends, SQLite (a file) and PostgreSQL (a real server this
module starts and stops): migrations, one writer per run across replicas (two stores on one database stand for
two experience replicas), statistics advanced atomically, versions issued once, weights by reference, and the
database's outage (UNAVAILABLE naming it, nothing written, recovery once it is back)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from fastexp.errors import AlreadyExists, FailedPrecondition, NotReady, Overloaded, PermissionDenied
from fastexp.rl.running import KLController, RunningMoments, RunState
from services.common.identity import caller_of
from services.common.weights import TensorEntry, WeightsBlobs, blob_digest
from services.experience.pipeline.statistics import StatisticsKey
from services.experience.runs.limits import LoraSpec, OperatorLimits, RunLimits
from services.experience.runs.registry import ReplicaIdentity, RunRegistry
from services.experience.state.ledger import StoredLedger
from services.experience.state.schema import metadata
from services.experience.state.statistics import StoredStatistics
from services.experience.state.store import StateStore

ALICE = caller_of(b"alice-token", admin=False)
BOB = caller_of(b"bob-token", admin=False)
OPERATOR = OperatorLimits(max_runs=8, max_lora_rank=16)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path) -> str:
    """A new, empty database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return request.getfixturevalue("postgres").create_database()


@pytest.fixture
def stores(database) -> Iterator[tuple[StateStore, StateStore]]:
    """Two stores on one database: two experience replicas' connections (migrated by the first)."""
    a, b = StateStore(database, timeout_s=5.0), StateStore(database, timeout_s=5.0)
    a.migrate()
    b.migrate()  # a second replica starting finds the schema current
    yield a, b
    a.close()
    b.close()


def _tensors(seed: int) -> list[TensorEntry]:
    generator = torch.Generator().manual_seed(seed)
    values = {"w": torch.randn(4, 8, generator=generator).to(torch.bfloat16), "b": torch.randn(8, generator=generator)}
    return [TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), lambda t=t: t)
            for name, t in values.items()]


def test_the_migrations_create_exactly_the_schema(stores):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    def differences(connection):
        return compare_metadata(MigrationContext.configure(connection), metadata)

    assert stores[0].transact_sync("comparing", differences) == []


async def test_a_run_created_on_one_replica_is_the_same_run_on_another(stores):
    a = RunRegistry(OPERATOR, stores[0], ReplicaIdentity.new("a"))
    b = RunRegistry(OPERATOR, stores[1], ReplicaIdentity.new("b"))
    await a.heartbeat()
    await b.heartbeat()
    created = (await a.create("r", ALICE, None, RunLimits(max_streams=1))).run
    assert (await b.get("r", ALICE)).run == created  # owner, limits, creation time: one record
    with pytest.raises(AlreadyExists):
        await b.create("r", BOB, None, RunLimits())  # not re-creatable by another tenant through another replica
    for action in (lambda: b.get("r", BOB), lambda: b.authorize_update("r", BOB), lambda: b.delete("r", BOB)):
        with pytest.raises(PermissionDenied, match="^run_id: "):
            await action()
    async with a.streaming("r", ALICE):
        with pytest.raises(Overloaded, match="^max_streams: "):
            async with b.streaming("r", ALICE):
                pass
        assert (await b.get("r", ALICE)).streams_open == 1
    assert (await b.delete("r", ALICE)).run.run_id == "r"
    assert await a.find("r") is None


async def test_statistics_advance_atomically_from_two_replicas_and_are_scoped_and_deleted(stores):
    registry = RunRegistry(OPERATOR, stores[0])
    await registry.create("r", ALICE, None, RunLimits())
    replicas = [StoredStatistics(store) for store in stores]
    initial = RunState(RunningMoments(), KLController(0.1))

    def one_reward(value: float):
        def step(state: RunState, _counted: frozenset[int]):
            return RunState(state.reward_moments.update(torch.tensor([value])), state.kl), None
        return step

    # 40 batches of one reward each, from two replicas at once: none lost (each read-modify-write holds the row)
    await asyncio.gather(*(replicas[i % 2].advance(StatisticsKey("r"), initial, one_reward(float(i)))
                           for i in range(40)))
    stored = (await registry.get("r", ALICE)).run.statistics
    assert stored.reward_count == 40 and stored.reward_mean == pytest.approx(19.5)
    # an id with no run is the caller's own: Bob's statistics of "x" are not Alice's
    await replicas[0].advance(StatisticsKey("x", ALICE.principal), initial, one_reward(1.0))
    seen = await replicas[1].advance(StatisticsKey("x", BOB.principal), initial, lambda s, _counted: (s, s))
    assert seen.reward_moments.count == 0
    # DeleteRun removes the run's statistics with it: a new run of that id starts afresh
    await registry.delete("r", ALICE)
    await registry.create("r", ALICE, None, RunLimits())
    assert (await registry.get("r", ALICE)).run.statistics.reward_count == 0


async def test_versions_are_issued_once_and_their_weights_found_by_reference(stores, tmp_path):
    blobs = WeightsBlobs(tmp_path / "weights")
    a, b = StoredLedger(stores[0], blobs), StoredLedger(stores[1], blobs)
    claims = await asyncio.gather(a.claim(target="policy"), b.claim(target="policy"), return_exceptions=True)
    won = [c for c in claims if not isinstance(c, BaseException)]
    assert len(won) == 1 and isinstance(next(c for c in claims if isinstance(c, BaseException)), Overloaded)
    await a.commit(won[0], 1, _tensors(1))
    snapshot = await b.snapshot()
    assert snapshot.policy.version == 1 and not snapshot.policy.updating
    loaded = {entry.name: entry.load() for entry in b.weights(snapshot.policy.weights_digest)}
    assert all(torch.equal(loaded[entry.name], entry.load()) for entry in _tensors(1))
    # a failed update releases its claim and leaves the live version
    claim = await b.claim(target="policy")
    assert claim.live.version == 1
    await b.commit(claim, None)
    assert (await a.snapshot()).policy.version == 1
    # a LoRA run on any replica blocks base updates everywhere
    await RunRegistry(OPERATOR, stores[1]).create("lora", ALICE, LoraSpec(8), RunLimits(), lambda: 16)
    with pytest.raises(FailedPrecondition, match="LoRA runs lora"):
        await a.claim(target="policy")
    # a corrupt blob is refused, naming it
    data = blobs.path(snapshot.policy.weights_digest) / "tensors.bin"
    data.write_bytes(b"\0" + data.read_bytes()[1:])
    with pytest.raises(NotReady, match="is corrupt"):
        a.weights(snapshot.policy.weights_digest)
    # blobs no live version names are collected; the live one stays
    digest = blobs.put(_tensors(2))
    assert await a.digest(_tensors(2)) == blob_digest(_tensors(2)) == digest  # what names a blob before it is written
    assert await a.collect(grace_s=0.0) == [digest]


async def test_many_streams_at_once_queue_for_the_pools_connections(database):
    store = StateStore(database, timeout_s=10.0, pool_size=2)
    store.migrate()
    try:
        registry = RunRegistry(OPERATOR, store)
        await registry.heartbeat()
        for run in "abcd":
            await registry.create(run, ALICE, None, RunLimits(max_streams=64))

        async def one_stream(run: str):
            async with registry.streaming(run, ALICE):
                await registry.get(run, ALICE)

        # 200 streams at once over 4 runs: 800 transactions queue for 2 connections, none fails
        await asyncio.gather(*(one_stream("abcd"[i % 4]) for i in range(200)))
        assert [s.streams_open for s in await registry.list(ALICE)] == [0, 0, 0, 0]
    finally:
        store.close()


async def test_postgresql_stopped_is_unavailable_naming_it_then_recovers(postgres):
    url = postgres.create_database()
    store = StateStore(url, timeout_s=3.0)
    store.migrate()
    registry = RunRegistry(OPERATOR, store)
    try:
        await registry.create("before", ALICE, None, RunLimits())
        postgres.stop()
        try:
            with pytest.raises(NotReady, match=r"^state store postgresql://fastexp@127\.0\.0\.1:\d+/fastexp_\w+ "
                                               r"unavailable \(CreateRun\)"):
                await registry.create("during", ALICE, None, RunLimits())
            with pytest.raises(NotReady, match="state store postgresql://"):
                await registry.get("before", ALICE)  # never an answer from memory
        finally:
            postgres.start()
        assert (await registry.get("before", ALICE)).run.owner == ALICE.principal
        assert await registry.find("during") is None  # nothing half-written
        await registry.create("during", ALICE, None, RunLimits())
    finally:
        store.close()


def test_a_store_url_of_another_kind_is_refused_naming_the_setting():
    from services.experience.state.store import StoreConfigError

    for url in ("mysql://x/y", "sqlite://", "not a url"):
        with pytest.raises(StoreConfigError, match="^state_url: "):
            StateStore(url)

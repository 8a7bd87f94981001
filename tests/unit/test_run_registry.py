"""Runs without a network: the pure checks of a run's id, LoRA spec and limits against the operator's, the ownership
decisions, the registry's bookkeeping (creation, listing, stream slots released however a stream ends), the status
codes of the run errors, and a run on the wire and back."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from fastexp.errors import (
    AlreadyExists,
    FailedPrecondition,
    FastexpError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
)
from fastexp.runs import LoraSpec as ClientLora
from fastexp.runs import RunLimits as ClientLimits
from fastexp.status import attributed_error, code_of, received_error
from services.common.identity import ANONYMOUS, Caller, caller_of
from services.experience.runs.limits import (
    DEFAULT_LORA_TARGET_MODULES,
    MAX_RUN_ID_CHARS,
    LoraSpec,
    OperatorLimits,
    RunLimits,
    check_lora,
    check_run_id,
    check_servable,
    resolve_limits,
)
from services.experience.runs.registry import ReplicaIdentity, Run, RunRegistry, check_update, may_use
from services.experience.settings import ExperienceSettings
from services.experience.state.store import StateStore

OPERATOR = OperatorLimits(
    max_runs=2, defaults=RunLimits(max_streams=1, max_groups_ahead=8, max_tokens_per_request=1000, weight=1),
    ceilings=RunLimits(max_streams=4, max_groups_ahead=16, max_tokens_per_request=5000, weight=10),
    max_lora_rank=16, lora_target_modules=("q_proj", "v_proj"),
)
ALICE = caller_of(b"alice-token", admin=False)
BOB = caller_of(b"bob-token", admin=False)
ADMIN = caller_of(b"admin-token", admin=True)


# --- ids, LoRA specs, limits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("run_id", ["a", "grpo-qwen_0.5b.v2", "7" * MAX_RUN_ID_CHARS])
def test_run_ids_of_safe_characters_up_to_the_limit_pass(run_id):
    assert check_run_id(run_id) == run_id


@pytest.mark.parametrize("run_id", ["", "x" * (MAX_RUN_ID_CHARS + 1), "../etc", ".hidden", "a b", "a/b", "é", "-a"])
def test_other_run_ids_are_invalid_naming_run_id(run_id):
    with pytest.raises(InvalidRequest) as raised:
        check_run_id(run_id)
    assert raised.value.field == "run_id"


def test_a_lora_spec_gets_its_defaults_alpha_equal_to_rank_and_every_allowed_module():
    assert check_lora(LoraSpec(rank=8), OPERATOR) == LoraSpec(8, 8.0, ("q_proj", "v_proj"))
    assert check_lora(LoraSpec(16, 32.0, ("v_proj",)), OPERATOR) == LoraSpec(16, 32.0, ("v_proj",))


@pytest.mark.parametrize(("spec", "field"), [
    (LoraSpec(rank=0), "lora.rank"), (LoraSpec(rank=17), "lora.rank"),
    (LoraSpec(rank=4, alpha=-1.0), "lora.alpha"), (LoraSpec(rank=4, alpha=float("nan")), "lora.alpha"),
    (LoraSpec(rank=4, target_modules=("lm_head",)), "lora.target_modules"),
    (LoraSpec(rank=4, target_modules=("q_proj", "q_proj")), "lora.target_modules"),
])
def test_a_lora_spec_outside_the_operators_limits_is_invalid_naming_the_field(spec, field):
    with pytest.raises(InvalidRequest) as raised:
        check_lora(spec, OPERATOR)
    assert raised.value.field == field
    if field == "lora.rank":
        assert "max_lora_rank" in raised.value.reason and "16" in raised.value.reason


def test_limits_left_zero_take_the_defaults_and_asked_ones_stay_within_the_ceilings():
    assert resolve_limits(RunLimits(), OPERATOR) == OPERATOR.defaults
    assert resolve_limits(RunLimits(max_streams=4, weight=3), OPERATOR) == RunLimits(4, 8, 1000, 3)
    for name, value in [("max_streams", 5), ("max_groups_ahead", 17), ("max_tokens_per_request", 5001), ("weight", 11)]:
        with pytest.raises(InvalidRequest) as raised:
            resolve_limits(RunLimits(**{name: value}), OPERATOR)
        assert raised.value.field == f"limits.{name}"


def test_operator_limits_refuse_a_default_above_its_ceiling():
    with pytest.raises(ValueError, match="max_streams: default 5 not in 1..4"):
        OperatorLimits(defaults=RunLimits(5, 8, 1000, 1), ceilings=RunLimits(4, 16, 5000, 10))


def test_lora_runs_need_adapters_of_their_rank_served():
    check_servable(None, 0)
    with pytest.raises(FailedPrecondition, match="^lora: this deployment serves no LoRA adapters"):
        check_servable(LoraSpec(4), 0)
    with pytest.raises(FailedPrecondition, match="^lora.rank: 8; .* up to rank 4"):
        check_servable(LoraSpec(8), 4)
    check_servable(LoraSpec(4), 4)


def test_the_settings_defaults_give_rank_16_on_the_attention_and_mlp_projections():
    limits = ExperienceSettings(max_concurrent_streams=4).run_limits()
    assert limits.max_lora_rank == 16 and limits.lora_target_modules == DEFAULT_LORA_TARGET_MODULES
    assert limits.defaults.max_streams == 4 == limits.ceilings.max_streams  # the default capped at the service's


# --- identities and ownership -----------------------------------------------------------------------------------

def test_a_caller_is_named_by_its_tokens_hash_never_the_token():
    assert ALICE.principal.startswith("sha256:") and "alice" not in ALICE.principal
    assert caller_of(b"alice-token", admin=True).principal == ALICE.principal  # the same token, either file
    assert ALICE.display == ALICE.principal[:len("sha256:") + 12] and ANONYMOUS.display == "anonymous"


@pytest.fixture
def store(state_store):
    return state_store


async def _enter_stream(registry: RunRegistry, run_id: str, caller: Caller) -> None:
    async with registry.streaming(run_id, caller):
        pass


async def test_the_owner_and_admin_tokens_may_use_a_run_others_may_not(store):
    registry = RunRegistry(OPERATOR, store, clock=lambda: 1.5)
    run = (await registry.create("r", ALICE, None, RunLimits())).run
    assert (run.owner, run.created_at_unix_s, run.lora) == (ALICE.principal, 1.5, None)
    assert may_use(run, ALICE) and may_use(run, ADMIN) and not may_use(run, BOB)
    for action in (lambda: registry.get("r", BOB), lambda: registry.delete("r", BOB),
                   lambda: registry.authorize_update("r", BOB), lambda: _enter_stream(registry, "r", BOB)):
        with pytest.raises(PermissionDenied, match="^run_id: "):
            await action()
    assert (await registry.get("r", ADMIN)).run == run


async def test_a_base_model_runs_weights_are_the_deployments_updating_them_needs_an_admin_token(store):
    registry = RunRegistry(OPERATOR, store)
    run = (await registry.create("r", ALICE, None, RunLimits())).run
    with pytest.raises(PermissionDenied, match="needs an admin token"):
        await registry.authorize_update("r", ALICE)
    assert await registry.authorize_update("r", ADMIN) == run
    lora_run = Run("adapter", ALICE.principal, LoraSpec(4, 4.0, ("q_proj",)), OPERATOR.defaults, 0.0)
    assert check_update(lora_run, ALICE) == lora_run  # an adapter's owner will update it without admin


async def test_everything_is_anonymous_and_allowed_with_tokens_off(store):
    registry = RunRegistry(OPERATOR, store)
    await registry.create("r", ANONYMOUS, None, RunLimits())
    assert (await registry.get("r", ANONYMOUS)).run.owner_display == "anonymous"
    assert [s.run.run_id for s in await registry.list(ANONYMOUS)] == ["r"]


# --- the registry ---------------------------------------------------------------------------------------------

async def test_create_checks_id_spec_and_limits_then_lora_then_duplicates_then_max_runs(store):
    registry = RunRegistry(OPERATOR, store)
    with pytest.raises(InvalidRequest, match="^lora.rank"):
        await registry.create("r", ALICE, LoraSpec(rank=64), RunLimits())
    with pytest.raises(FailedPrecondition):
        await registry.create("r", ALICE, LoraSpec(rank=8), RunLimits())  # no adapters served: the default
    await registry.create("r", ALICE, None, RunLimits())
    with pytest.raises(AlreadyExists, match="^run_id: "):
        await registry.create("r", BOB, None, RunLimits())
    await registry.create("s", BOB, None, RunLimits())
    with pytest.raises(Overloaded, match="^max_runs: "):
        await registry.create("t", BOB, None, RunLimits())
    assert len(await registry.list(ADMIN)) == 2


async def test_list_shows_a_caller_its_own_runs_and_an_admin_all_of_them(store):
    registry = RunRegistry(OPERATOR, store)
    await registry.create("b-run", BOB, None, RunLimits())
    await registry.create("a-run", ALICE, None, RunLimits())
    assert [s.run.run_id for s in await registry.list(ALICE)] == ["a-run"]
    assert [s.run.run_id for s in await registry.list(ADMIN)] == ["a-run", "b-run"]
    assert await registry.list(Caller("sha256:other")) == ()


async def test_stream_slots_are_counted_limited_and_released_however_the_stream_ends(store):
    registry = RunRegistry(OPERATOR, store)
    await registry.heartbeat()
    await registry.create("r", ALICE, None, RunLimits(max_streams=2))
    async with registry.streaming("r", ALICE) as run, registry.streaming("r", ADMIN):
        assert run.run_id == "r" and (await registry.get("r", ALICE)).streams_open == 2
        with pytest.raises(Overloaded, match="^max_streams: "):
            await _enter_stream(registry, "r", ALICE)
        with pytest.raises(FailedPrecondition, match="2 MakeExperiences streams open"):
            await registry.delete("r", ALICE)
    with pytest.raises(RuntimeError):
        async with registry.streaming("r", ALICE):
            raise RuntimeError("the stream failed")
    assert (await registry.get("r", ALICE)).streams_open == 0
    assert (await registry.delete("r", ALICE)).run.run_id == "r"
    with pytest.raises(NotFound, match="^run_id: "):
        await registry.get("r", ALICE)


async def test_a_run_id_no_run_was_created_for_names_statistics_only_unchecked_and_uncounted(store):
    registry = RunRegistry(OPERATOR, store)
    async with registry.streaming("someone-elses-stats", BOB) as run, registry.streaming("", BOB) as none:
        assert run is None and none is None


async def test_two_replicas_share_runs_owners_and_stream_slots(store, tmp_path):
    # two registries on one store: what replica A created, replica B sees, owned, not re-creatable, slots shared
    a = RunRegistry(OPERATOR, store, ReplicaIdentity.new("a"))
    other = StateStore(f"sqlite:///{tmp_path / 'state.db'}", timeout_s=5.0)
    b = RunRegistry(OPERATOR, other, ReplicaIdentity.new("b"))
    try:
        await a.heartbeat()
        await b.heartbeat()
        await a.create("r", ALICE, None, RunLimits(max_streams=1))
        with pytest.raises(AlreadyExists):
            await b.create("r", BOB, None, RunLimits())
        with pytest.raises(PermissionDenied):
            await b.get("r", BOB)
        async with a.streaming("r", ALICE):
            with pytest.raises(Overloaded, match="^max_streams: "):
                await _enter_stream(b, "r", ALICE)
        await _enter_stream(b, "r", ALICE)
    finally:
        other.close()


async def test_a_killed_replicas_stream_slots_stop_counting_after_its_ttl(store):
    now = [100.0]
    a = RunRegistry(OPERATOR, store, ReplicaIdentity.new("a", ttl_s=30.0), clock=lambda: now[0])
    b = RunRegistry(OPERATOR, store, ReplicaIdentity.new("b", ttl_s=30.0), clock=lambda: now[0])
    await a.heartbeat()
    await b.heartbeat()
    await a.create("r", ALICE, None, RunLimits(max_streams=1))
    slot = a.streaming("r", ALICE)
    await slot.__aenter__()  # replica a is "killed" holding the slot: it never exits, never beats again
    with pytest.raises(Overloaded):
        await _enter_stream(b, "r", ALICE)
    now[0] += 31.0
    await b.heartbeat()  # b is alive; a is silent for longer than its ttl
    await _enter_stream(b, "r", ALICE)
    assert (await b.get("r", ALICE)).streams_open == 0


async def test_a_resumed_stream_takes_over_the_slot_its_killed_replica_held(store):
    a = RunRegistry(OPERATOR, store, ReplicaIdentity.new("a", ttl_s=30.0))
    b = RunRegistry(OPERATOR, store, ReplicaIdentity.new("b", ttl_s=30.0))
    await a.heartbeat()
    await b.heartbeat()
    await a.create("r", ALICE, None, RunLimits(max_streams=1))
    slot = a.streaming("r", ALICE, stream_id="s-1")
    await slot.__aenter__()  # replica a is "killed" holding stream s-1's slot
    with pytest.raises(Overloaded):
        await _enter_stream(b, "r", ALICE)  # another stream: the run is at max_streams
    with pytest.raises(Overloaded):  # s-1 opened again without resume takes nothing over: refused too
        async with b.streaming("r", ALICE, stream_id="s-1"):
            pass
    async with b.streaming("r", ALICE, stream_id="s-1", resume=True):  # s-1 resumed on b: a's slot is its own
        assert (await b.get("r", ALICE)).streams_open == 1


# --- the status table ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("error", "code"), [
    (PermissionDenied("run_id: not yours"), grpc.StatusCode.PERMISSION_DENIED),
    (NotFound("run_id: no run"), grpc.StatusCode.NOT_FOUND),
    (AlreadyExists("run_id: taken"), grpc.StatusCode.ALREADY_EXISTS),
])
def test_the_run_errors_have_their_codes_both_ways(error, code):
    assert code_of(error) == code
    received = received_error(code, str(error))
    assert isinstance(received, type(error)) and received.code() == code


def test_a_peers_permission_denied_is_relayed_as_internal_not_as_the_callers_own():
    relayed = attributed_error("generator a:1", received_error(grpc.StatusCode.PERMISSION_DENIED, "needs admin"))
    assert type(relayed) is FastexpError and code_of(relayed) == grpc.StatusCode.INTERNAL


# --- the wire -----------------------------------------------------------------------------------------------------

def test_a_run_goes_to_the_wire_and_back_to_the_trainers_record():
    from fastexp.runs import create_run_request, run_from_pb
    from services.experience.api.runs import limits_from_pb, lora_from_pb, run_to_pb
    from services.experience.runs.registry import RunStatus

    request = create_run_request("r", lora_rank=4, target_modules=["q_proj"], limits=ClientLimits(max_streams=2))
    assert lora_from_pb(request.lora) == LoraSpec(4, 0.0, ("q_proj",))
    assert limits_from_pb(request.limits) == RunLimits(max_streams=2)
    assert not create_run_request("base").HasField("lora")
    with pytest.raises(ValueError, match="need lora_rank"):
        create_run_request("base", lora_alpha=8.0)
    run = Run("r", ALICE.principal, LoraSpec(4, 4.0, ("q_proj",)), OPERATOR.defaults, 12.5)
    record = run_from_pb(run_to_pb(RunStatus(run, streams_open=1), policy_version=3))
    assert (record.run_id, record.policy_version, record.streams_open, record.created_at_unix_s) == ("r", 3, 1, 12.5)
    assert record.lora == ClientLora(4, 4.0, ("q_proj",)) and record.owner == ALICE.display
    assert record.limits == ClientLimits(1, 8, 1000, 1)
    assert record.groups_in_flight is None and record.groups_queued is None
    base = run_from_pb(run_to_pb(RunStatus(Run("b", "anonymous", None, OPERATOR.defaults, 0.0), 0), 0))
    assert base.lora is None and base.owner == "anonymous"


async def test_a_stream_cancelled_while_its_slot_is_taken_gives_the_slot_back(store, monkeypatch):
    # the slot's transaction is held until the stream was cancelled; it commits, and the slot is given back
    import asyncio
    import threading

    from services.experience.state import rows

    started, release, real = threading.Event(), threading.Event(), rows.open_slot

    def held_open_slot(*args, **kwargs):
        started.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(rows, "open_slot", held_open_slot)
    registry = RunRegistry(OPERATOR, store, ReplicaIdentity.new("a", ttl_s=3600.0))  # its slots always count
    await registry.heartbeat()
    await registry.create("r", ALICE, None, RunLimits(max_streams=1))
    entering = asyncio.ensure_future(_enter_stream(registry, "r", ALICE))
    assert await asyncio.to_thread(started.wait, 10)  # the event: the slot is being taken
    entering.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await entering
    release.set()
    monkeypatch.setattr(rows, "open_slot", real)
    async with asyncio.timeout(10):  # given back once the transaction that took it committed
        while (await registry.get("r", ALICE)).streams_open:
            await asyncio.sleep(0.01)
    await _enter_stream(registry, "r", ALICE)  # the run's one slot is free

"""Per-run policy versions (PolicyClocks): a LoRA run's adapter clock moves alone; a generator replica lacking a live
adapter is found by its ModelInfo; a LoRA run's stream is refused until its adapter was sent, and for what no LoRA
run has here (a critic, agent episodes)."""

from __future__ import annotations

import dataclasses

import pytest

from fastexp.errors import FailedPrecondition, InvalidRequest
from fastexp.rl.advantages import ESTIMATORS
from services.experience.api.runs import check_lora_stream
from services.experience.config import AgentOptions, ExperienceConfig
from services.experience.fleet.readiness import GeneratorInfo
from services.experience.fleet.replica_state import lacks_adapters
from services.experience.pipeline.versions import PolicyClocks
from services.experience.runs.limits import LoraSpec, RunLimits
from services.experience.runs.registry import Run

LORA_RUN = Run("alice-lora", "anonymous", LoraSpec(4, 4.0, ("q_proj",)), RunLimits(1, 1, 1, 1), 0.0)
CONFIG = ExperienceConfig(n_samples_per_prompt=2, estimator=ESTIMATORS["group_norm"])


async def test_each_adapter_has_its_own_clock_and_the_base_is_none():
    clocks = PolicyClocks()
    assert clocks.of(None) is clocks.base
    a, b = clocks.of("a"), clocks.of("b")
    assert a is clocks.of("a") and a is not b and clocks.live_adapters() == {}  # version 0: nothing live
    b_begun = b.update_begun()
    await a.begin_update()
    assert not b_begun.is_set() and not clocks.base.updating  # another run's groups are not aborted
    await a.end_update(1)
    assert clocks.live_adapters() == {"a": 1} and b.version == 0 and clocks.base.version == 0
    clocks.forget("a")
    assert clocks.live_adapters() == {} and clocks.of("a").version == 0  # a new run of that name starts again


async def test_an_adapter_being_updated_is_live_but_not_settled():
    """While run a's update is applied a replica may already hold its next version: the fleet's probe checks the
    settled adapters only, and does not take the replica out for it."""
    clocks = PolicyClocks()
    a = clocks.of("a")
    await a.begin_update()
    assert clocks.live_adapters() == {} and clocks.settled_adapters() == {}
    await a.end_update(1)
    await clocks.of("b").begin_update()
    await clocks.of("b").end_update(1)
    await a.begin_update()
    assert clocks.live_adapters() == {"a": 1, "b": 1} and clocks.settled_adapters() == {"b": 1}
    await a.end_update(2)
    assert clocks.settled_adapters() == {"a": 2, "b": 1}


def test_a_replica_lacks_an_adapter_it_misses_or_holds_at_another_version():
    info = GeneratorInfo("m", "hf", 256, 0, adapters={"a": 2, "old": 1})
    assert not lacks_adapters(info, {})
    assert not lacks_adapters(info, {"a": (2, None)})  # adapters beyond the live ones are not checked
    assert lacks_adapters(info, {"a": (3, None)})
    assert lacks_adapters(info, {"a": (2, None), "b": (1, None)})


def test_a_replica_holding_a_deleted_runs_adapter_it_was_not_told_to_unload_needs_a_resync():
    info = GeneratorInfo("m", "hf", 256, 0, adapters={"a": 1, "old": 1})
    assert lacks_adapters(info, {"a": (1, None)}, stale={"old"})  # a new run named "old" would start at version 1 too
    assert lacks_adapters(info, {"a": (1, None), "old": (1, None)}, stale={"old"})
    assert not lacks_adapters(info, {"a": (1, None)}, stale={"gone"})  # it unloaded that one after all, or restarted


def test_an_adapter_held_under_another_digest_is_a_deleted_runs_copy_whoever_deleted_it():
    """No ``stale`` set here (the run was deleted through another experience replica, or before a restart): the
    copy a generator replica kept has the new run's name and version, and only its digest tells it apart."""
    info = GeneratorInfo("m", "hf", 256, 0, adapters={"old": 1}, adapter_digests={"old": "sha256:" + "1" * 64})
    assert lacks_adapters(info, {"old": (1, "sha256:" + "2" * 64)})
    assert not lacks_adapters(info, {"old": (1, "sha256:" + "1" * 64)})
    unnamed = GeneratorInfo("m", "hf", 256, 0, adapters={"old": 1}, adapter_digests={"old": ""})
    assert lacks_adapters(unnamed, {"old": (1, "sha256:" + "1" * 64)})  # loaded without one: sent again, named
    assert not lacks_adapters(unnamed, {"old": (1, None)})  # a local ledger names none


def test_a_lora_run_streams_once_its_adapter_was_sent_and_only_what_it_can():
    base_run = dataclasses.replace(LORA_RUN, lora=None)
    check_lora_stream(dataclasses.replace(CONFIG, estimator=ESTIMATORS["gae"]), base_run, 0)  # base runs: unchecked
    with pytest.raises(FailedPrecondition, match="^run_id: LoRA run 'alice-lora' has no adapter yet"):
        check_lora_stream(CONFIG, LORA_RUN, 0)
    check_lora_stream(CONFIG, LORA_RUN, 1)
    with pytest.raises(InvalidRequest) as refused:
        check_lora_stream(dataclasses.replace(CONFIG, estimator=ESTIMATORS["gae"]), LORA_RUN, 1)
    assert refused.value.field == "advantage_estimator"
    with pytest.raises(InvalidRequest) as refused:
        check_lora_stream(dataclasses.replace(CONFIG, agent=AgentOptions("calculator", 4)), LORA_RUN, 1)
    assert refused.value.field == "agent"

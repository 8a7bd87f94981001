"""Runs on a real experience service with bearer tokens on (the three services in process, HF backend, tiny Llama,
float32; the generator behind a gated proxy, tests/support/gates.py, to hold streams in flight): the trainer
client's create/get/list/delete; a run is its creating token's (another call token is refused everything, an admin
token may do everything); ``max_runs`` and a run's ``max_streams`` answer RESOURCE_EXHAUSTED naming them and a
cancelled stream gives its slot back; LoRA specs are checked, and a LoRA run streams only once its adapter was sent; with
tokens off everything is "anonymous"'s and allowed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from fastexp import ExperienceClient, Sampling, build_request
from fastexp.channels import ClientEdge
from fastexp.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
)
from fastexp.v1 import experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.common.identity import caller_of
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.gates import gated

ALICE = "alice-token-0c41"  # noqa: S105 - test credentials
BOB = "bob-token-7e2a"  # noqa: S105
ADMIN = "admin-token-51d9"  # noqa: S105
MAX_RUNS = 3
MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
async def stack(tiny_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "call-tokens").write_text(f"{ALICE}\n{BOB}\n")
    (folder / "admin-tokens").write_text(f"{ADMIN}\n")
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    scorer_settings = ScorerSettings(port=0, sources=[
        {"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    async with gated("generator", f"127.0.0.1:{generator.port}") as (generator_address, gate):
        common = {"port": 0, "generator_address": generator_address, "scorer_address": f"127.0.0.1:{scorer.port}",
                  "actor_model": tiny_model_path, "reference_model": tiny_model_path, "dtype": "float32",
                  "max_runs": MAX_RUNS, "max_lora_rank": MAX_LORA_RANK}
        secured = await start_experience(ExperienceSettings(
            **common, auth_tokens_file=folder / "call-tokens", admin_tokens_file=folder / "admin-tokens"))
        open_service = await start_experience(ExperienceSettings(**common))  # tokens off (loopback)
        for service in (secured, open_service):
            await service.wait_ready(60)
        yield {"address": f"127.0.0.1:{secured.running.port}", "open": f"127.0.0.1:{open_service.running.port}",
               "gate": gate, "services": (secured, open_service)}
        for service in (secured, open_service):
            await service.running.stop(1)
            await service.close()
    await scorer.stop(1)
    await scorer_core.close()
    await generator.stop(1)
    await engine.close()


def _client(stack, token: str | None) -> ExperienceClient:
    return ExperienceClient(stack["address"] if token else stack["open"], timeout_s=120, token=token)


async def _call(stack, token: str | None, method: str, *args, **kwargs):
    """``ExperienceClient(token).<method>(*args, **kwargs)`` off the event loop (the client blocks)."""

    def call():
        with _client(stack, token) as client:
            result = getattr(client, method)(*args, **kwargs)
            return list(result) if method == "make_experiences" else result

    return await asyncio.to_thread(call)


async def _stream(stack, token: str | None, run_id: str) -> list:
    return await _call(stack, token, "make_experiences", ["What is 2 + 3?"], n_samples_per_prompt=2,
                       sampling=Sampling(max_new_tokens=4), run_id=run_id)


def _norm_tensor(tiny_model_path: str):
    from safetensors.torch import load_file

    return [("model.norm.weight", load_file(str(Path(tiny_model_path) / "model.safetensors"))["model.norm.weight"])]


async def _until(condition, timeout_s: float = 120.0) -> None:
    """Wait until the coroutine function ``condition()`` holds, checking every 50 ms (polling a state, not a delay)."""

    async def check() -> None:
        while not await condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(check(), timeout_s)


# --- the lifecycle --------------------------------------------------------------------------------------------

async def test_a_trainer_creates_gets_lists_streams_and_deletes_its_run(stack):
    created = await _call(stack, ALICE, "create_run", "alice-base", weight=2)
    assert created.run_id == "alice-base" and created.lora is None and created.streams_open == 0
    assert created.owner == caller_of(ALICE.encode(), admin=False).display and ALICE not in created.owner
    settings = ExperienceSettings()
    assert (created.limits.max_streams, created.limits.weight) == (settings.run_default_max_streams, 2)
    assert created.limits.max_tokens_per_request == settings.max_tokens_per_request  # the service's, by default
    assert created.groups_in_flight == 0 and created.groups_queued == 0  # nothing generating yet
    assert created.created_at_unix_s > 0
    assert await _call(stack, ALICE, "get_run", "alice-base") == created
    assert [r.run_id for r in await _call(stack, ALICE, "list_runs")] == ["alice-base"]
    batches = await _stream(stack, ALICE, "alice-base")
    assert sum(len(b.reward) for b in batches) == 2
    run_series = {"run_id": "alice-base"}  # the per-run metrics, as Prometheus scrapes them
    assert REGISTRY.get_sample_value("fastexp_run_samples_total", run_series) == 2
    assert REGISTRY.get_sample_value("fastexp_run_tokens_total", run_series) == sum(
        int(b.response_length.sum()) for b in batches)
    # each replica of the store (both services are in this process and report to one registry) reports what it saw
    # at its last change to the runs or its last heartbeat: the open service's heartbeat, falling while the stream
    # was open (CI, 2026-11-26), reported it open until its next one. Both taken here, not waited for
    for service in stack["services"]:
        await service.runs.heartbeat()
    assert REGISTRY.get_sample_value("fastexp_run_streams_open", run_series) == 0
    assert REGISTRY.get_sample_value("fastexp_run_policy_version", run_series) == 0
    with pytest.raises(AlreadyExists):
        await _call(stack, BOB, "create_run", "alice-base")
    deleted = await _call(stack, ALICE, "delete_run", "alice-base")
    assert deleted.run_id == "alice-base"
    assert REGISTRY.get_sample_value("fastexp_run_samples_total", run_series) is None  # its series are gone
    # the deleting replica reports the run no more; another replica of the store (the open service, in this
    # process too) reports what its last heartbeat saw, and drops it at its next one: taken here, not waited for
    await stack["services"][1].runs.heartbeat()
    assert REGISTRY.get_sample_value("fastexp_run_streams_open", run_series) is None
    with pytest.raises(NotFound) as missing:
        await _call(stack, ALICE, "get_run", "alice-base")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "run_id" in missing.value.details()


async def test_a_run_id_no_run_was_created_for_still_names_statistics_only(stack):
    batches = await _stream(stack, BOB, "bob-statistics")  # as before runs existed: no run needed
    assert sum(len(b.reward) for b in batches) == 2
    assert await _call(stack, BOB, "list_runs") == []


async def test_a_per_run_token_budget_below_the_services_is_enforced_naming_it(stack):
    await _call(stack, ALICE, "create_run", "alice-small", max_tokens_per_request=7)
    try:
        with pytest.raises(Overloaded) as refused:
            await _stream(stack, ALICE, "alice-small")  # 1 prompt x 2 samples x 4 tokens = 8 > 7
        assert refused.value.details().startswith("max_tokens_per_request:")
    finally:
        await _call(stack, ALICE, "delete_run", "alice-small")


# --- ownership ------------------------------------------------------------------------------------------------

async def test_another_token_is_denied_the_run_and_does_not_see_it_an_admin_token_may(stack, tiny_model_path):
    await _call(stack, ALICE, "create_run", "alice-private")
    try:
        for method, args in [("get_run", ()), ("delete_run", ())]:
            with pytest.raises(PermissionDenied) as denied:
                await _call(stack, BOB, method, "alice-private", *args)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert denied.value.details().startswith("run_id: ")
        with pytest.raises(PermissionDenied) as denied:
            await _stream(stack, BOB, "alice-private")
        assert denied.value.details().startswith("run_id: ")
        with pytest.raises(PermissionDenied) as denied:
            await _call(stack, BOB, "update_weights", _norm_tensor(tiny_model_path), run_id="alice-private")
        assert denied.value.details().startswith("run_id: ") and "another token" in denied.value.details()
        assert await _call(stack, BOB, "list_runs") == []
        # its owner may not replace the base model everyone samples either: that takes an admin token
        with pytest.raises(PermissionDenied, match="needs an admin token"):
            await _call(stack, ALICE, "update_weights", _norm_tensor(tiny_model_path), run_id="alice-private")
        # an admin token may do everything
        before = (await _call(stack, ADMIN, "get_run", "alice-private")).policy_version
        updated = await _call(stack, ADMIN, "update_weights", _norm_tensor(tiny_model_path), run_id="alice-private")
        assert updated.policy_version == before + 1
        assert (await _call(stack, ALICE, "get_run", "alice-private")).policy_version == before + 1
        assert "alice-private" in [r.run_id for r in await _call(stack, ADMIN, "list_runs")]
        assert sum(len(b.reward) for b in await _stream(stack, ADMIN, "alice-private")) == 2
    finally:
        assert (await _call(stack, ADMIN, "delete_run", "alice-private")).run_id == "alice-private"


async def test_update_weights_naming_no_run_or_an_unknown_run_stays_refused_to_call_tokens(stack, tiny_model_path):
    with pytest.raises(PermissionDenied, match="UpdateWeights needs an admin token"):
        await _call(stack, BOB, "update_weights", _norm_tensor(tiny_model_path))
    with pytest.raises(NotFound, match="run_id: no run .nobody."):
        await _call(stack, BOB, "update_weights", _norm_tensor(tiny_model_path), run_id="nobody")


async def test_with_tokens_off_everything_is_anonymous_and_allowed(stack, tiny_model_path):
    run = await _call(stack, None, "create_run", "open-run")
    assert run.owner == "anonymous"
    assert [r.run_id for r in await _call(stack, None, "list_runs")] == ["open-run"]
    assert sum(len(b.reward) for b in await _stream(stack, None, "open-run")) == 2
    await _call(stack, None, "update_weights", _norm_tensor(tiny_model_path), run_id="open-run")
    await _call(stack, None, "delete_run", "open-run")


# --- limits ---------------------------------------------------------------------------------------------------

async def test_runs_past_max_runs_are_refused_naming_it(stack):
    names = [f"filler-{i}" for i in range(MAX_RUNS)]
    try:
        for name in names:
            await _call(stack, BOB, "create_run", name)
        with pytest.raises(Overloaded) as refused:
            await _call(stack, ALICE, "create_run", "one-too-many")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("max_runs: ")
    finally:
        for name in names:
            await _call(stack, BOB, "delete_run", name)
    await _call(stack, ALICE, "create_run", "one-too-many")  # room again
    await _call(stack, ALICE, "delete_run", "one-too-many")


async def test_a_runs_streams_past_max_streams_are_refused_and_a_cancelled_stream_gives_its_slot_back(stack):
    await _call(stack, ALICE, "create_run", "alice-streams", max_streams=1)
    gate = stack["gate"]
    request = build_request(["Count: 1, 2,"], n_samples_per_prompt=2, sampling=Sampling(max_new_tokens=4),
                            run_id="alice-streams")
    channel = grpc.aio.insecure_channel(stack["address"], interceptors=ClientEdge(ALICE).for_aio())
    stub = experience_pb2_grpc.ExperienceServiceStub(channel)

    async def streams_open() -> int:
        return (await _call(stack, ALICE, "get_run", "alice-streams")).streams_open

    async def no_stream_open() -> bool:
        return await streams_open() == 0

    try:
        held = gate.held
        gate.close()  # the first stream waits in Generate: open, not finished
        first = stub.MakeExperiences(request, timeout=120)
        reading = asyncio.create_task(first.read())
        await gate.wait_held(held + 1)
        assert await streams_open() == 1
        with pytest.raises(Overloaded) as refused:
            async for _ in stub.MakeExperiences(request, timeout=60):
                pass
        assert refused.value.details().startswith("max_streams: ")
        first.cancel()  # the trainer hangs up
        await asyncio.gather(reading, return_exceptions=True)
        await _until(no_stream_open)  # released by the server as the cancelled stream ends
        gate.open()
        batches = [experience_from_pb(m) async for m in stub.MakeExperiences(request, timeout=120)]  # the slot is free
        assert sum(len(b.reward) for b in batches) == 2
    finally:
        gate.open()
        await channel.close()
        await _call(stack, ALICE, "delete_run", "alice-streams")


async def test_a_lora_run_is_checked_against_the_limits_and_streams_only_once_its_adapter_was_sent(stack):
    with pytest.raises(InvalidRequest) as invalid:
        await _call(stack, ALICE, "create_run", "alice-lora", lora_rank=MAX_LORA_RANK + 1)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and invalid.value.field == "lora.rank"
    assert "max_lora_rank" in invalid.value.reason
    with pytest.raises(InvalidRequest) as invalid:
        await _call(stack, ALICE, "create_run", "alice-lora", lora_rank=4, target_modules=["lm_head"])
    assert invalid.value.field == "lora.target_modules"
    created = await _call(stack, ALICE, "create_run", "alice-lora", lora_rank=4, lora_alpha=8.0)
    assert created.lora is not None and (created.lora.rank, created.lora.alpha) == (4, 8.0)
    assert created.policy_version == 0  # no adapter yet
    with pytest.raises(FailedPrecondition) as refused:
        await _stream(stack, ALICE, "alice-lora")
    assert "run_id: LoRA run 'alice-lora' has no adapter yet" in str(refused.value)
    await _call(stack, ALICE, "delete_run", "alice-lora")
    with pytest.raises(InvalidRequest) as invalid:
        await _call(stack, ALICE, "create_run", "bad id/with slash")
    assert invalid.value.field == "run_id"
    assert await _call(stack, ALICE, "list_runs") == []


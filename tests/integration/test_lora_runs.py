"""LoRA runs end to end on real services (issue 33): the three services in process (HF generator, tiny Llama in
float32, rule scorer, experience service with bearer tokens on), two tenants' LoRA runs and a third token.

alice's run is rank 8 on the operator's default modules, bob's rank 4 on q_proj/v_proj; each is sent an adapter
built here with peft (A and B drawn from a seeded generator, large enough to change what the model samples).
Greedy streams of both runs at once give, for each run, ``action_log_probs`` equal to an independent peft forward
with that run's adapter (``LoraConfig`` + ``get_peft_model`` + ``set_peft_model_state_dict`` on a fresh copy of the
model), ``base_action_log_probs`` equal to the plain base model's, tokens the adapter's greedy choices and
``rollout_log_probs`` (the generator's) equal to ``action_log_probs``: the generator sampled with the adapter. A new
version of alice's adapter changes alice's rows only; a third token is refused both runs (PERMISSION_DENIED on
streaming and updating); of the two generator replicas, one restarted on the same port gets both live adapters
before it serves again (the streams meanwhile lose no group). Groups on a replica taken out before their stream's
task started are rerouted (a fleet bug this module found). A deleted run's adapter leaves every replica; a replica
that could not be told (down, or cut off with its adapters kept) returns without it, and never serves its
leftover copy to a new run of the same name.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from dataclasses import dataclass, replace

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from fastexp import ExperienceClient, Sampling
from fastexp.errors import PermissionDenied
from fastexp.runs import LoraSpec
from fastexp.types import Experience
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.inprocess import Recording

ALICE = "alice-token-3f8a"  # noqa: S105 - test credentials
BOB = "bob-token-91c4"  # noqa: S105
CAROL = "carol-token-6d07"  # noqa: S105
ADMIN = "admin-token-e25b"  # noqa: S105
REPLICAS = ("a", "b")
PROMPTS = ["What is 2 + 3?", "Name a colour."]
N_SAMPLES = 2
NEW_TOKENS = 8
GREEDY = Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)  # every row NEW_TOKENS long
#: std of every lora_A and lora_B entry: B @ A (about 0.03 per entry at rank 8) outweighs the tiny model's own
#: weights (std 0.02), so an adapter changes the log-probs by far more than the tolerances below.
ADAPTER_STD = 0.1
#: The service's batched, padded forwards against each row forwarded alone in float32 (observed: about 1e-5).
TOLERANCE = 1e-4
#: An adapter's log-probs differ from the base's by at least this much somewhere in every row.
ADAPTER_EFFECT = 1e-2


@dataclass(frozen=True)
class LiveRun:
    """A run as the test knows it: its owner's token, its LoRA spec (as CreateRun answered it), the adapter tensors
    sent last (peft-named) and the version they are live as."""

    run_id: str
    token: str
    lora: LoraSpec
    tensors: dict[str, torch.Tensor]
    version: int


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on 2 shared cores OpenMP threads wait on each other at every barrier. Log-probs do not
    depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
async def stack(tiny_model_path, tmp_path_factory):
    """Two generator replicas ("a", and "b" which a test restarts), the scorer and the experience service."""
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "call-tokens").write_text(f"{ALICE}\n{BOB}\n{CAROL}\n")
    (folder / "admin-tokens").write_text(f"{ADMIN}\n")
    replicas = {name: await _start_replica(tiny_model_path, port=0) for name in REPLICAS}
    scorer_settings = ScorerSettings(port=0, sources=[
        {"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    settings = ExperienceSettings(
        port=0, generator_addresses=[r.address for r in replicas.values()], scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=tiny_model_path, reference_model=tiny_model_path, dtype="float32",
        auth_tokens_file=folder / "call-tokens", admin_tokens_file=folder / "admin-tokens")
    service = await start_experience(settings)
    await service.wait_ready(60)
    state = {"address": f"127.0.0.1:{service.running.port}", "replicas": replicas, "service": service,
             "settings": settings}
    await _until(lambda: all(_replica_up(r.address) for r in replicas.values()))
    yield state
    await state["service"].running.stop(1)
    await state["service"].close()
    await scorer.stop(1)
    await scorer_core.close()
    for replica in state["replicas"].values():
        await replica.stop()


@dataclass(frozen=True)
class Replica:
    """A generator replica in process: its server, its engine (HF, float32) and the engine's completions."""

    running: RunningServer
    engine: HFEngine
    recording: Recording

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    async def stop(self) -> None:
        await self.running.stop(0)
        await self.engine.close()


async def _start_replica(model_path: str, port: int) -> Replica:
    """A fresh HF engine (no adapters) served on ``port`` (0: any free one)."""
    engine = HFEngine.start(model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    assert engine.adapters.live() == {}, "a fresh engine holds no adapter"
    recording = Recording(engine)
    return Replica(await start_generator(GeneratorSettings(port=port, max_model_len=256), engine), engine, recording)


def _replica_up(address: str) -> bool:
    """Whether the experience service routes work to the replica now (its fastexp_generator_replica_up gauge)."""
    return REGISTRY.get_sample_value("fastexp_generator_replica_up", {"replica": address}) == 1


async def _until(condition, timeout_s: float = 120.0) -> None:
    """Wait until the coroutine function or function ``condition()`` holds, checking every 50 ms (polling a state,
    not a delay)."""

    async def check() -> None:
        while True:
            held = condition()
            if asyncio.iscoroutine(held):
                held = await held
            if held:
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(check(), timeout_s)


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    """The plain base model in float32: the reference, and what each peft model is built on (a fresh copy)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
async def runs(stack, base_model):
    """alice's and bob's LoRA runs, each sent its first adapter (version 1); the test that updates one replaces
    its record here. Deleted at the end with an admin token."""
    alice = await _call(stack, ALICE, "create_run", "alice-lora", lora_rank=8)
    bob = await _call(stack, BOB, "create_run", "bob-lora", lora_rank=4, target_modules=["q_proj", "v_proj"])
    assert alice.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (alice.lora.rank, alice.lora.alpha, bob.lora.rank, bob.lora.alpha) == (8, 8.0, 4, 4.0)  # alpha: the rank
    assert bob.lora.target_modules == ("q_proj", "v_proj")
    live = {}
    for run, token, seed in ((alice, ALICE, 1), (bob, BOB, 2)):
        tensors = make_adapter(base_model, run.lora, seed)
        updated = await _call(stack, token, "update_weights", tensors.items(), run_id=run.run_id)
        assert updated.policy_version == 1 and updated.num_tensors == len(tensors)
        live[token] = LiveRun(run.run_id, token, run.lora, tensors, updated.policy_version)
    yield live
    for run in live.values():
        await _call(stack, ADMIN, "delete_run", run.run_id)


# --- peft, independently ----------------------------------------------------------------------------------------

def _lora_config(spec: LoraSpec):
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), lora_dropout=0.0)


def make_adapter(base_model, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """An adapter of ``spec`` on the base model as peft's ``get_peft_model_state_dict`` names it
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: (rank, in)), every lora_A and lora_B
    entry N(0, ADAPTER_STD²) from a generator seeded with ``seed``."""
    from peft import get_peft_model, get_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(base_model), _lora_config(spec))
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                parameter.copy_(ADAPTER_STD * torch.randn(parameter.shape, generator=noise))
    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}


def peft_model(base_model, spec: LoraSpec, tensors: dict[str, torch.Tensor]):
    """A fresh copy of the base model with the adapter loaded by peft (nothing of the services involved)."""
    from peft import get_peft_model, set_peft_model_state_dict

    model = get_peft_model(copy.deepcopy(base_model), _lora_config(spec))
    loaded = set_peft_model_state_dict(model, tensors)
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    assert not [k for k in loaded.missing_keys if ".lora_" in k], loaded.missing_keys  # every adapter tensor taken
    return model.eval()


@torch.inference_mode()
def response_log_probs(model, batch: Experience, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``row`` of ``batch`` forwarded alone (its real tokens, no padding): the log-probs of its response tokens
    (full logits, log-softmax) and the tokens the model would pick greedily there. Shape: both (response_length,)."""
    width = batch.sequences.shape[1] - batch.action_mask.shape[1]  # the prompts' padded width
    real = batch.attention_mask[row].bool()
    ids = batch.sequences[row][real].unsqueeze(0)
    logits = model(input_ids=ids).logits[0].float()
    start = int(real[:width].sum()) - 1  # the position predicting the first response token
    positions = torch.arange(start, start + int(batch.response_length[row]))
    log_probs = torch.log_softmax(logits[positions], dim=-1)
    return log_probs.gather(-1, ids[0, positions + 1].unsqueeze(-1))[:, 0], log_probs.argmax(-1)


def assert_rows_follow(batches: list[Experience], run: LiveRun, adapted, base) -> None:
    """Every row of ``batches``: sampled greedily by the adapter at the run's live version, its action_log_probs
    the adapter's, its base_action_log_probs the base's, the generator's own log-probs the adapter's."""
    rows = [(b, r) for b in batches for r in range(len(b.reward))]
    assert len(rows) == len(PROMPTS) * N_SAMPLES
    for batch, row in rows:
        length = int(batch.response_length[row])
        mask = batch.action_mask[row][:length]
        assert length == NEW_TOKENS and bool(mask.all())
        assert batch.policy_version[row] == run.version and batch.actor_policy_version == run.version
        expected, greedy = response_log_probs(adapted, batch, row)
        expected_base, _ = response_log_probs(base, batch, row)
        width = batch.sequences.shape[1] - batch.action_mask.shape[1]
        response = batch.sequences[row][width:width + length]
        assert torch.equal(response, greedy), f"{run.run_id} row {row}: not the adapter's greedy tokens"
        actor = batch.action_log_probs[row][:length]
        torch.testing.assert_close(actor, expected, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(batch.base_action_log_probs[row][:length], expected_base, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(batch.rollout_log_probs[row][:length], actor, atol=TOLERANCE, rtol=0)
        assert float((expected - expected_base).abs().max()) > ADAPTER_EFFECT, "the adapter changes the log-probs"


# --- the services -----------------------------------------------------------------------------------------------

async def _call(stack, token: str, method: str, *args, **kwargs):
    """``ExperienceClient(token).<method>(*args, **kwargs)`` off the event loop (the client blocks)."""

    def call():
        with ExperienceClient(stack["address"], timeout_s=120, token=token) as client:
            result = getattr(client, method)(*args, **kwargs)
            return list(result) if method == "make_experiences" else result

    return await asyncio.to_thread(call)


async def _stream(stack, token: str, run_id: str) -> list[Experience]:
    return await _call(stack, token, "make_experiences", PROMPTS, n_samples_per_prompt=N_SAMPLES, sampling=GREEDY,
                       run_id=run_id)


async def _stream_both(stack, runs) -> dict[str, list[Experience]]:
    """One stream of each run, both open at once (two client threads)."""
    alice, bob = runs[ALICE], runs[BOB]
    batches = await asyncio.gather(_stream(stack, ALICE, alice.run_id), _stream(stack, BOB, bob.run_id))
    return dict(zip((ALICE, BOB), batches, strict=True))


def _rows(batches: list[Experience]) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """(prompt index, sample index) → (sequence's real tokens, action log-probs over the mask)."""
    return {(b.prompt_index[r], b.sample_index[r]): (b.sequences[r][b.attention_mask[r].bool()],
                                                     b.action_log_probs[r][b.action_mask[r]])
            for b in batches for r in range(len(b.reward))}


async def _generator_adapters(stack, field: str = "version") -> dict[str, dict[str, int | str]]:
    """Each replica's own GetModelInfo: its adapters, name → ``field`` (the live ``version``, or the
    ``weights_digest`` their LoadAdapter named)."""
    adapters = {}
    for name, replica in stack["replicas"].items():
        async with grpc.aio.insecure_channel(replica.address) as channel:
            info = await generation_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=30)
        adapters[name] = {a.name: getattr(a, field) for a in info.adapters}
    return adapters


def _on_every_replica(versions: dict[str, int]) -> dict[str, dict[str, int]]:
    return dict.fromkeys(REPLICAS, versions)


async def _versions(stack, runs) -> dict[str, int]:
    """GetRun's live version of each run, asked by its owner."""
    return {run.run_id: (await _call(stack, run.token, "get_run", run.run_id)).policy_version
            for run in runs.values()}


async def _new_carol_run_then_b_reachable(stack, base_model, b, leftover, seed: int) -> None:
    """Carol makes a new run of the deleted run's name (rank 4 on v_proj: the leftover copy was on q_proj), sent
    version 1 while b, cut off, still holds the leftover; then b is reachable again on its port (same engine), and
    this returns once b holds the new run's adapter in the leftover's place."""
    carol = await _call(stack, CAROL, "create_run", "carol-lora", lora_rank=4, target_modules=["v_proj"])
    tensors = make_adapter(base_model, carol.lora, seed=seed)
    assert (await _call(stack, CAROL, "update_weights", tensors.items(), run_id=carol.run_id)).policy_version == 1
    assert b.engine.adapters.live()["carol-lora"] is leftover, "b was cut off: it still holds the deleted run's copy"
    running = await start_generator(GeneratorSettings(port=b.running.port, max_model_len=256), b.engine)
    stack["replicas"]["b"] = replace(b, running=running)

    def resynced() -> bool:
        slot = b.engine.adapters.live().get("carol-lora")
        return slot is not None and slot.config.target_modules == ("v_proj",)

    await _until(resynced)


# --- the tests --------------------------------------------------------------------------------------------------

async def test_two_runs_streaming_at_once_each_sample_and_forward_with_their_own_adapter(stack, runs, base_model):
    assert await _versions(stack, runs) == {"alice-lora": 1, "bob-lora": 1}
    assert await _generator_adapters(stack) == _on_every_replica({"alice-lora": 1, "bob-lora": 1})
    streamed = await _stream_both(stack, runs)
    for token, run in runs.items():
        assert_rows_follow(streamed[token], run, peft_model(base_model, run.lora, run.tensors), base_model)
    alice_rows, bob_rows = _rows(streamed[ALICE]), _rows(streamed[BOB])
    assert any(not torch.equal(alice_rows[k][0], bob_rows[k][0]) for k in alice_rows), "two adapters, two samplings"


async def test_an_update_of_one_run_changes_its_rows_only(stack, runs, base_model):
    before = await _stream_both(stack, runs)
    alice = runs[ALICE]
    tensors = make_adapter(base_model, alice.lora, seed=3)
    updated = await _call(stack, ALICE, "update_weights", tensors.items(), run_id=alice.run_id)
    assert updated.policy_version == alice.version + 1
    runs[ALICE] = alice = replace(alice, tensors=tensors, version=updated.policy_version)
    live = {"alice-lora": alice.version, "bob-lora": runs[BOB].version}  # bob's unchanged
    assert await _versions(stack, runs) == live
    assert await _generator_adapters(stack) == _on_every_replica(live)
    after = await _stream_both(stack, runs)
    bob_before, bob_after = _rows(before[BOB]), _rows(after[BOB])
    assert bob_before.keys() == bob_after.keys()
    for key, (sequence, log_probs) in bob_before.items():  # greedy: the same tokens and log-probs as before
        assert torch.equal(bob_after[key][0], sequence), f"bob's row {key} changed"
        torch.testing.assert_close(bob_after[key][1], log_probs, atol=TOLERANCE, rtol=0)
    assert_rows_follow(after[BOB], runs[BOB], peft_model(base_model, runs[BOB].lora, runs[BOB].tensors), base_model)
    assert_rows_follow(after[ALICE], alice, peft_model(base_model, alice.lora, tensors), base_model)
    alice_before, alice_after = _rows(before[ALICE]), _rows(after[ALICE])
    assert any(not torch.equal(alice_after[k][0], alice_before[k][0]) for k in alice_before), "the new adapter samples"


async def test_a_third_token_is_denied_streaming_and_updating_either_run(stack, runs):
    versions = await _versions(stack, runs)
    for run in runs.values():
        with pytest.raises(PermissionDenied) as denied:
            await _stream(stack, CAROL, run.run_id)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert denied.value.details().startswith("run_id: ")
        with pytest.raises(PermissionDenied) as denied:  # the run's own adapter shapes: refused for the token alone
            await _call(stack, CAROL, "update_weights", run.tensors.items(), run_id=run.run_id)
        assert denied.value.details().startswith("run_id: ") and "another token" in denied.value.details()
    assert await _call(stack, CAROL, "list_runs") == []  # nor does it see them
    assert await _versions(stack, runs) == versions
    assert await _generator_adapters(stack) == _on_every_replica(versions)


@pytest.mark.parametrize("overlap", [False, True], ids=["stopped-then-started", "started-then-stopped"])
async def test_a_restarted_replica_gets_every_live_adapter_before_it_serves_again(
    stack, runs, base_model, tiny_model_path, overlap
):
    """Replica b restarts: stopped, then a fresh one started on its port (its probes and calls fail meanwhile); or
    the fresh one started on the port first (gRPC servers bind with SO_REUSEPORT) and the old one stopped (a restart
    between two probes: the next call finds a replica without the adapters, which refuses it)."""
    live = {run.run_id: run.version for run in runs.values()}
    old = stack["replicas"]["b"]
    if not overlap:
        await old.stop()
    stack["replicas"]["b"] = restarted = await _start_replica(tiny_model_path, port=old.running.port)
    if overlap:
        await old.stop()
    # streams while it comes back (one after the other: two at once can hang, see the xfail test below): groups that
    # reach it before it has the adapters go to the other replica
    for token, run in runs.items():
        batches = await _stream(stack, token, run.run_id)
        assert_rows_follow(batches, run, peft_model(base_model, run.lora, run.tensors), base_model)

    async def synced_and_serving() -> bool:  # its probe found it without the adapters; it was sent them
        return _replica_up(restarted.address) and (await _generator_adapters(stack))["b"] == live

    await _until(synced_and_serving)
    sampled_before = len(restarted.recording.completions)
    streamed = await _stream_both(stack, runs)
    for token, run in runs.items():
        assert_rows_follow(streamed[token], run, peft_model(base_model, run.lora, run.tensors), base_model)
    sampled = restarted.recording.completions[sampled_before:]
    assert sampled, "the restarted replica took groups again"
    assert {c.policy_version for c in sampled} <= set(live.values())
    assert await _generator_adapters(stack) == _on_every_replica(live)
    assert await _versions(stack, runs) == live


async def test_groups_on_a_replica_taken_out_before_their_stream_starts_are_rerouted(stack):
    """The fleet over the two replicas: replica b is taken out the moment work begins on it (in the same event-loop
    turn as the dispatch that created its stream's task, as when another stream's failure on b takes b out): its
    groups must go to replica a."""
    from fastexp.sampling import SamplingOptions
    from services.common.channels import open_channel
    from services.common.deadlines import Deadline
    from services.common.generation import CompletionRecord, GenerationRequest
    from services.experience.fleet.clients import GeneratorClient
    from services.experience.fleet.generator_fleet import GeneratorFleet
    from services.experience.fleet.replica_state import ReplicaState

    # its own names for the replicas ("localhost", not "127.0.0.1"): its per-replica gauges must not replace the
    # experience service's, which the other tests read
    addresses = {name: f"localhost:{r.running.port}" for name, r in stack["replicas"].items()}
    fleet = GeneratorFleet(list(addresses.values()), lambda a: GeneratorClient(open_channel(a, 64 * 2**20), 60, 60, a))
    members = fleet.members
    watching = asyncio.create_task(fleet.run())
    taking_out = None
    try:
        async with asyncio.timeout(60):
            await members.changes.wait_until(lambda: len(fleet.replicas) == 2 and all(map(members.routable,
                                                                                           fleet.replicas)))
        victim = next(r for r in fleet.replicas if r.address == addresses["b"])

        async def take_out_as_work_begins() -> None:
            await members.changes.wait_until(lambda: bool(victim.streams))
            members.take_out(victim, ReplicaState.DOWN, "taken out as work began on it")

        taking_out = asyncio.create_task(take_out_as_work_begins())
        request = GenerationRequest("taken-out", ((100, 101, 102), (103, 101, 102)),
                                    SamplingOptions(temperature=0.0, max_new_tokens=4), n_samples_per_prompt=2)
        async with asyncio.timeout(20), contextlib.aclosing(fleet.generate(request, Deadline.from_remaining(60))) as out:
            records = [r async for r in out if isinstance(r, CompletionRecord)]
        assert taking_out.done(), "replica b got work and was taken out"
        assert sorted((r.prompt_index, r.sample_index) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finally:
        tasks = [t for t in (watching, taking_out) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.close()


async def _carols_run(stack, base_model, seed: int) -> dict[str, int]:
    """carol's LoRA run "carol-lora" (rank 4 on q_proj), created and sent its first adapter; the adapters each
    replica then lists (the same on both)."""
    carol = await _call(stack, CAROL, "create_run", "carol-lora", lora_rank=4, target_modules=["q_proj"])
    tensors = make_adapter(base_model, carol.lora, seed)
    assert (await _call(stack, CAROL, "update_weights", tensors.items(), run_id=carol.run_id)).policy_version == 1
    return (await _generator_adapters(stack))["a"]


async def test_a_deleted_runs_adapter_leaves_every_replica_and_the_other_runs_stream_on(stack, runs, base_model):
    live = {run.run_id: run.version for run in runs.values()}
    assert await _carols_run(stack, base_model, seed=4) == {**live, "carol-lora": 1}
    assert await _generator_adapters(stack) == _on_every_replica({**live, "carol-lora": 1})
    await _call(stack, CAROL, "delete_run", "carol-lora")
    assert await _generator_adapters(stack) == _on_every_replica(live)
    streamed = await _stream_both(stack, runs)
    for token, run in runs.items():
        assert_rows_follow(streamed[token], run, peft_model(base_model, run.lora, run.tensors), base_model)


async def test_a_run_deleted_while_a_replica_is_down_is_gone_and_the_replica_returns_without_it(
    stack, runs, base_model, tiny_model_path, caplog
):
    """Replica b is stopped, the run deleted (it cannot be told: logged, not an error), b started again on its
    port: it is sent the live runs' adapters, not the deleted one."""
    live = {run.run_id: run.version for run in runs.values()}
    assert await _carols_run(stack, base_model, seed=5) == {**live, "carol-lora": 1}  # the name again, from 0
    old = stack["replicas"]["b"]
    await old.stop()
    await _call(stack, CAROL, "delete_run", "carol-lora")
    assert f"generator replica {old.address} did not unload adapter 'carol-lora'" in caplog.text
    assert (await _generator_adapters({"replicas": {"a": stack["replicas"]["a"]}}))["a"] == live
    stack["replicas"]["b"] = await _start_replica(tiny_model_path, port=old.running.port)

    async def synced() -> bool:  # its probe found it without the live adapters; it was sent them
        return _replica_up(stack["replicas"]["b"].address) and (await _generator_adapters(stack))["b"] == live

    await _until(synced)
    assert await _generator_adapters(stack) == _on_every_replica(live)
    assert await _call(stack, CAROL, "list_runs") == []


async def test_a_replica_cut_off_at_a_deletion_never_serves_its_leftover_copy_to_a_new_run_of_that_name(
    stack, runs, base_model
):
    """Replica b is cut off (its server stopped, its engine and adapters kept: a network partition, not a restart)
    while carol's run is deleted, and carol makes a new run of that name (rank 4 on v_proj, not q_proj) before b is
    reachable again. b's leftover copy is at version 1, the new run's live version too: b must unload it and be
    sent the new run's adapter before it serves."""
    live = {run.run_id: run.version for run in runs.values()}
    assert await _carols_run(stack, base_model, seed=6) == {**live, "carol-lora": 1}
    b = stack["replicas"]["b"]
    leftover = b.engine.adapters.live()["carol-lora"]
    assert leftover.config.target_modules == ("q_proj",)
    await b.running.stop(0)
    await _call(stack, CAROL, "delete_run", "carol-lora")
    await _new_carol_run_then_b_reachable(stack, base_model, b, leftover, seed=7)
    assert await _generator_adapters(stack) == _on_every_replica({**live, "carol-lora": 1})
    await _call(stack, CAROL, "delete_run", "carol-lora")
    assert await _generator_adapters(stack) == _on_every_replica(live)


async def test_a_leftover_copy_is_told_apart_by_its_digest_after_the_deleting_service_is_gone(
    stack, runs, base_model
):
    """As above, but the experience service that deleted the run is gone before b is reachable again (restarted on
    the same store: a rolling update, or the deletion went through another replica), so no one remembers that b
    missed the deletion. b's leftover copy has the new run's name and version 1: the digest b reports for it (its
    LoadAdapter named the old blob) differs from the live one's, so b is sent the new run's adapter before it
    serves, and every replica reports the live blob's digest."""
    live = {run.run_id: run.version for run in runs.values()}
    assert await _carols_run(stack, base_model, seed=8) == {**live, "carol-lora": 1}
    b = stack["replicas"]["b"]
    leftover = b.engine.adapters.live()["carol-lora"]
    await b.running.stop(0)
    await _call(stack, CAROL, "delete_run", "carol-lora")
    await stack["service"].running.stop(1)
    await stack["service"].close()
    port = stack["service"].running.port  # the trainers' address stays
    stack["service"] = await start_experience(stack["settings"].model_copy(update={"port": port}))
    await stack["service"].wait_ready(60)
    await _new_carol_run_then_b_reachable(stack, base_model, b, leftover, seed=9)
    digests = await _generator_adapters(stack, "weights_digest")
    assert digests["a"]["carol-lora"] == digests["b"]["carol-lora"] != ""
    assert digests["a"]["carol-lora"].startswith("sha256:")
    await _call(stack, CAROL, "delete_run", "carol-lora")
    assert await _generator_adapters(stack) == _on_every_replica(live)


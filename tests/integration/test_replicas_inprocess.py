"""Two experience replicas sharing one state store (issue 42), in process: one HF generator (tiny Llama, float32),
a rule scorer, experience services A and B. A policy update that carries only some tensors, sent through a replica
that had not loaded the live version yet, applies to the live version. LoRA runs (tokens on, the module's store):
what a tenant does through one replica holds on the other: alice's adapter sent through A is what B's streams sample and
forward (B loads it from its blob), a new version sent through B is what A then uses, bob can neither update
alice's adapter nor take her run id through either replica, and a run deleted through B and made again through A
(another rank, other modules; or the same, at the same version number) is never served with the old adapter
anywhere."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from fastexp import ExperienceClient
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.integration.test_lora_runs import (
    GREEDY,
    N_SAMPLES,
    NEW_TOKENS,
    PROMPTS,
    TOLERANCE,
    make_adapter,
    one_thread,  # noqa: F401 - the module's autouse fixture: one torch thread
    peft_model,
    response_log_probs,
)
from tests.support.gates import Gate, gated

ALICE, BOB, ADMIN = "alice-token-7b1e", "bob-token-0c52", "admin-token-44d9"  # noqa: S105 - test credentials


class Replicas(dict):
    """Replica name -> address; ``services``: the running experience services, A's first; ``scorer_gate``: the
    gate in front of their scorer."""

    services: list
    scorer_gate: Gate


@contextlib.asynccontextmanager
async def _two_replicas(model_path: str, **experience) -> AsyncIterator[Replicas]:
    """One HF generator, a rule scorer and experience replicas A and B (``experience``: their common settings; the
    state store the module's unless named); yields their addresses (and services)."""
    engine = HFEngine.start(model_path, dtype="float32", max_model_len=256, max_batch_size=4)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    scorer_settings = ScorerSettings(port=0, sources=[
        {"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    services = []
    try:
        async with gated("scorer", f"127.0.0.1:{scorer.port}") as (scorer_address, gate):
            for _ in "AB":
                service = await start_experience(ExperienceSettings(
                    port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=scorer_address,
                    actor_model=model_path, reference_model=model_path, dtype="float32", **experience))
                services.append(service)
                await service.wait_ready(60)
            replicas = Replicas((name, f"127.0.0.1:{s.running.port}") for name, s in zip("AB", services, strict=True))
            replicas.services, replicas.scorer_gate = services, gate
            yield replicas
    finally:
        for service in services:
            await service.running.stop(1)
            await service.close()
        await scorer.stop(1)
        await scorer_core.close()
        await generator.stop(0)
        await engine.close()


@pytest.fixture(scope="module")
async def replicas(tiny_model_path, tmp_path_factory):
    """The addresses of experience replicas A and B, bearer tokens on, on the module's state store."""
    folder = tmp_path_factory.mktemp("tokens")
    (folder / "call-tokens").write_text(f"{ALICE}\n{BOB}\n")
    (folder / "admin-tokens").write_text(f"{ADMIN}\n")
    async with _two_replicas(tiny_model_path, state_poll_interval_s=0.2, auth_tokens_file=folder / "call-tokens",
                             admin_tokens_file=folder / "admin-tokens") as addresses:
        yield addresses


async def _call(address: str, token: str, method: str, *args, **kwargs):
    def call():
        with ExperienceClient(address, timeout_s=120, token=token) as client:
            result = getattr(client, method)(*args, **kwargs)
            return list(result) if method == "make_experiences" else result

    return await asyncio.to_thread(call)


def _assert_rows_follow(batches, adapted, version: int) -> None:
    rows = [(b, r) for b in batches for r in range(len(b.reward))]
    assert len(rows) == len(PROMPTS) * N_SAMPLES
    for batch, row in rows:
        assert int(batch.response_length[row]) == NEW_TOKENS
        assert batch.policy_version[row] == version and batch.actor_policy_version == version
        expected, greedy = response_log_probs(adapted, batch, row)
        width = batch.sequences.shape[1] - batch.action_mask.shape[1]
        assert torch.equal(batch.sequences[row][width:width + NEW_TOKENS], greedy), "not the adapter's tokens"
        torch.testing.assert_close(batch.action_log_probs[row][:NEW_TOKENS], expected, atol=TOLERANCE, rtol=0)


async def _stream(address: str, run_id: str):
    return await _call(address, ALICE, "make_experiences", PROMPTS, n_samples_per_prompt=N_SAMPLES, sampling=GREEDY,
                       run_id=run_id)


async def _denied(code: grpc.StatusCode, call) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value.details()


async def test_a_tenants_adapter_is_the_same_on_every_replica_and_nobody_elses(replicas, tiny_model_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    run = await _call(replicas["A"], ALICE, "create_run", "alice-lora", lora_rank=8)
    first = make_adapter(base, run.lora, seed=1)
    assert (await _call(replicas["A"], ALICE, "update_weights", first.items(), run_id="alice-lora")).policy_version == 1
    # B never saw the update: it loads version 1 from its blob before the stream
    _assert_rows_follow(await _stream(replicas["B"], "alice-lora"), peft_model(base, run.lora, first), 1)
    second = make_adapter(base, run.lora, seed=2)
    assert (await _call(replicas["B"], ALICE, "update_weights", second.items(), run_id="alice-lora")).policy_version == 2
    _assert_rows_follow(await _stream(replicas["A"], "alice-lora"), peft_model(base, run.lora, second), 2)
    # bob, through either replica: not alice's adapter, not her run id
    for address in replicas.values():
        await _denied(grpc.StatusCode.PERMISSION_DENIED,
                      _call(address, BOB, "update_weights", first.items(), run_id="alice-lora"))
        await _denied(grpc.StatusCode.ALREADY_EXISTS, _call(address, BOB, "create_run", "alice-lora", lora_rank=4))
    # deleted through B, made again through A with another rank and modules: its version 1 is the new adapter
    await _call(replicas["B"], ALICE, "delete_run", "alice-lora")
    again = await _call(replicas["A"], ALICE, "create_run", "alice-lora", lora_rank=4, target_modules=["q_proj", "v_proj"])
    third = make_adapter(base, again.lora, seed=3)
    assert (await _call(replicas["A"], ALICE, "update_weights", third.items(), run_id="alice-lora")).policy_version == 1
    for address in replicas.values():
        _assert_rows_follow(await _stream(address, "alice-lora"), peft_model(base, again.lora, third), 1)
    # once more, the same shape and the same version number: B holds "alice-lora" version 1 already, of the old run
    await _call(replicas["A"], ALICE, "delete_run", "alice-lora")
    await _call(replicas["A"], ALICE, "create_run", "alice-lora", lora_rank=4, target_modules=["q_proj", "v_proj"])
    fourth = make_adapter(base, again.lora, seed=4)
    assert (await _call(replicas["A"], ALICE, "update_weights", fourth.items(), run_id="alice-lora")).policy_version == 1
    _assert_rows_follow(await _stream(replicas["B"], "alice-lora"), peft_model(base, again.lora, fourth), 1)


async def test_an_adapter_whose_blob_cannot_be_written_is_live_nowhere_and_its_run_serves_on(replicas, tiny_model_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    run = await _call(replicas["A"], ALICE, "create_run", "alice-unstored", lora_rank=8)
    first, second = make_adapter(base, run.lora, seed=5), make_adapter(base, run.lora, seed=6)
    # the weights folder gone, a file in its place: a blob cannot be written while the generator loads the adapter
    folder = Path(os.environ["FASTEXP_EXPERIENCE_WEIGHTS_DIR"])
    aside = folder.with_name("weights-aside")

    async def refused(adapter) -> None:
        folder.rename(aside)
        folder.write_text("not a folder")
        try:
            with pytest.raises(grpc.RpcError) as raised:
                await _call(replicas["A"], ALICE, "update_weights", adapter.items(), run_id="alice-unstored")
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
            assert "could not be stored, so it is not live anywhere" in raised.value.details()
        finally:
            folder.unlink()
            aside.rename(folder)

    await refused(first)  # its first adapter: unloaded from the generator again, the run still has none
    with pytest.raises(grpc.RpcError, match="has no adapter yet"):
        await _stream(replicas["B"], "alice-unstored")
    assert (await _call(replicas["A"], ALICE, "update_weights", first.items(), run_id="alice-unstored")).policy_version == 1
    await refused(second)  # its second: the generator put back on version 1, from its blob
    # the generator, which had loaded version 2, samples version 1 again, as both replicas forward
    for address in replicas.values():
        _assert_rows_follow(await _stream(address, "alice-unstored"), peft_model(base, run.lora, first), 1)
    # and the run takes its next update: the claim was released
    assert (await _call(replicas["A"], ALICE, "update_weights", second.items(), run_id="alice-unstored")).policy_version == 2
    _assert_rows_follow(await _stream(replicas["B"], "alice-unstored"), peft_model(base, run.lora, second), 2)
    await _call(replicas["A"], ALICE, "delete_run", "alice-unstored")


async def test_a_partial_update_through_a_replica_that_lags_applies_to_the_live_version(tiny_model_path, tmp_path):
    # replicas that never poll (state_poll_interval_s: 10 min): one tensor changed through A (version 1), then
    # another through B, which had not loaded version 1 yet; version 2 is both changes, whoever streams it
    from transformers import AutoModelForCausalLM

    from tests.integration.test_policy_updates import _forward_log_probs

    state = {"state_url": f"sqlite:///{tmp_path / 'state.db'}", "weights_dir": tmp_path / "weights"}
    async with _two_replicas(tiny_model_path, state_poll_interval_s=600.0, **state) as addresses:
        a, b = addresses["A"], addresses["B"]
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
        noise = torch.Generator().manual_seed(5)
        changed = {}
        for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
            parameter = dict(model.named_parameters())[name]
            with torch.no_grad():
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=noise))
            changed[name] = parameter.detach().clone()
        first, second = list(changed.items())
        assert (await _call(a, None, "update_weights", [first])).policy_version == 1
        assert (await _call(b, None, "update_weights", [second])).policy_version == 2
        batches = await _call(a, None, "make_experiences", PROMPTS, n_samples_per_prompt=N_SAMPLES, sampling=GREEDY)
        for batch in batches:  # A loads version 2's blob before the stream: both changes, not B's alone
            assert batch.actor_policy_version == 2
            for row in range(len(batch.reward)):
                mask = batch.action_mask[row]
                torch.testing.assert_close(batch.action_log_probs[row][mask], _forward_log_probs(model, batch, row),
                                           atol=TOLERANCE, rtol=0)

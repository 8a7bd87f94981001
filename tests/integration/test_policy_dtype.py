"""Policy updates in the type the policy is served in (issue 45, adapter updates at the size of their bytes): the
three services in process with the policy in bfloat16 (HF generator, tiny Llama, rule scorer, experience service).

The service says its policy type (``ServerInfo.policy_dtype``: the actor replica's and the generator's, agreed), and
the SDK sends float32 policy tensors in it: a LoRA run's adapter arrives at the generator as the bfloat16 rounding of
what the trainer holds, in half the bytes; with ``in_policy_dtype=False`` it arrives as sent. A full update in the
policy type leaves exactly the weights a float32 one leaves (the receiver casts so itself), in half the bytes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from fastexp import ExperienceClient, Sampling
from fastexp.v1 import experience_pb2, experience_pb2_grpc
from services.common.dtypes import agreed_dtype
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings

GREEDY = Sampling(temperature=0.0, max_new_tokens=4, ignore_eos=True)


class AdapterLoads:
    """Wraps an engine's ``load_adapter`` to keep a copy of every adapter it was handed (name → tensors)."""

    def __init__(self, engine: HFEngine) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []
        self._load = engine.load_adapter
        engine.load_adapter = self.load_adapter

    async def load_adapter(self, name, config, tensors, version=None, **options):
        self.loads.append({key: tensor.clone() for key, tensor in tensors.items()})
        return await self._load(name, config, tensors, version, **options)


@pytest.fixture(scope="module")
async def stack(tiny_model_path):
    """One HF generator replica and the experience service, both in bfloat16, and the rule scorer."""
    engine = HFEngine.start(tiny_model_path, dtype="bfloat16", max_model_len=256, max_batch_size=4)
    loads = AdapterLoads(engine)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    scorer_settings = ScorerSettings(port=0, sources=[
        {"type": "rule", "name": "math_verify", "function": "services.scorer.rules:math_verify_reward", "workers": 1}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    settings = ExperienceSettings(
        port=0, generator_addresses=[f"127.0.0.1:{generator.port}"], scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=tiny_model_path, reference_model=tiny_model_path, dtype="bfloat16")
    service = await start_experience(settings)
    await service.wait_ready(120)
    yield {"address": f"127.0.0.1:{service.running.port}", "engine": engine, "loads": loads,
           "generator": f"127.0.0.1:{generator.port}", "settings": settings}
    await service.running.stop(1)
    await service.close()
    await scorer.stop(1)
    await scorer_core.close()
    await generator.stop(0)
    await engine.close()


async def _call(stack, method: str, *args, **kwargs):
    """``ExperienceClient.<method>(*args, **kwargs)`` off the event loop (the client blocks)."""

    def call():
        with ExperienceClient(stack["address"], timeout_s=120) as client:
            result = getattr(client, method)(*args, **kwargs)
            return list(result) if method == "make_experiences" else result

    return await asyncio.to_thread(call)


def _float32_bytes(tensors) -> int:
    return sum(tensor.numel() * 4 for _, tensor in tensors)


def _adapter(tiny_model_path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A rank-4 q/v adapter on the tiny model, peft-named, float32, every value N(0, 0.01) (not representable in
    bfloat16: rounding shows)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=noise))
    return sorted(get_peft_model_state_dict(model).items())


def test_the_policy_type_is_said_only_where_every_holder_agrees():
    assert agreed_dtype("bfloat16", "bfloat16") == "bfloat16"
    assert agreed_dtype("bfloat16", "float32") == ""  # a float32 generator: float32 tensors travel as they are
    assert agreed_dtype("bfloat16", "") == ""  # the fleet not reached yet, or an older generator
    assert agreed_dtype() == ""


async def _server_info(address: str) -> experience_pb2.ServerInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await experience_pb2_grpc.ExperienceServiceStub(channel).GetServerInfo(
            experience_pb2.GetServerInfoRequest(), timeout=30)


async def test_the_service_says_the_type_its_policy_is_served_in_only_where_its_actor_and_generators_agree(stack):
    info = await _server_info(stack["address"])
    assert info.policy_dtype == "bfloat16"
    assert "tensor-batches" in info.features
    # a second experience service whose actor runs in float32 over the same bf16 generator: no type to say
    other = await start_experience(stack["settings"].model_copy(update={"dtype": "float32"}))
    try:
        await other.wait_ready(120)
        assert (await _server_info(f"127.0.0.1:{other.running.port}")).policy_dtype == ""
    finally:
        await other.running.stop(1)
        await other.close()


async def test_a_float32_adapter_travels_in_the_policy_type_unless_the_trainer_says_otherwise(stack, tiny_model_path):
    run = await _call(stack, "create_run", "dtype-lora", lora_rank=4, target_modules=["q_proj", "v_proj"])
    try:
        adapter = _adapter(tiny_model_path, seed=3)
        assert all(tensor.dtype == torch.float32 for _, tensor in adapter)
        loads = stack["loads"].loads
        loads.clear()

        narrow = await _call(stack, "update_weights", adapter, run_id=run.run_id)
        assert (narrow.policy_version, narrow.num_bytes) == (1, _float32_bytes(adapter) // 2)
        held = loads[-1]
        assert {key: t.dtype for key, t in held.items()} == {key: torch.bfloat16 for key, _ in adapter}
        for key, tensor in adapter:
            assert torch.equal(held[key], tensor.to(torch.bfloat16)), key  # rounded once, by the trainer's SDK
        rows = await _call(stack, "make_experiences", ["What is 2 + 3?"], n_samples_per_prompt=2, sampling=GREEDY,
                           run_id=run.run_id)
        assert [int(v) for batch in rows for v in batch.policy_version] == [1, 1]  # sampled and forwarded so

        wide = await _call(stack, "update_weights", adapter, run_id=run.run_id, in_policy_dtype=False)
        assert (wide.policy_version, wide.num_bytes) == (2, _float32_bytes(adapter))
        for key, tensor in adapter:
            assert loads[-1][key].dtype == torch.float32 and torch.equal(loads[-1][key], tensor), key
    finally:
        await _call(stack, "delete_run", run.run_id)


async def test_a_full_update_in_the_policy_type_leaves_the_weights_a_float32_one_leaves(stack, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from services.generator.hf_adapters import base_state

    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    noise = torch.Generator().manual_seed(4)
    tensors = [(name, tensor.detach() + 0.01 * torch.randn(tensor.shape, generator=noise))  # tied ones once
               for name, tensor in sorted(trained.named_parameters())]
    live = base_state(stack["engine"]._model)  # the in-process engine's own tensors (read, not changed)

    narrow = await _call(stack, "update_weights", tensors)
    assert narrow.num_bytes == _float32_bytes(tensors) // 2
    after_narrow = {name: tensor.detach().clone() for name, tensor in live.items()}
    wide = await _call(stack, "update_weights", tensors, in_policy_dtype=False)
    assert wide.num_bytes == _float32_bytes(tensors)
    assert wide.policy_version == narrow.policy_version + 1
    compared = 0
    for name, tensor in tensors:
        if name in live:  # lm_head.weight is the tied embedding's, named once
            assert torch.equal(live[name], after_narrow[name]), name
            assert torch.equal(live[name], tensor.to(torch.bfloat16)), name
            compared += 1
    assert compared == len(tensors)


async def test_an_adapter_holding_nan_is_refused_naming_the_tensor_by_either_receiver_and_nothing_changes(
    stack, tiny_model_path
):
    from fastexp.errors import InvalidRequest
    from fastexp.v1 import generation_pb2_grpc
    from services.common.lora import AdapterConfig
    from services.common.weights.wire import adapter_chunks

    adapter = _adapter(tiny_model_path, seed=5)
    bad_name = adapter[len(adapter) // 2][0]  # neither the first tensor nor the last
    poisoned = [(name, tensor.clone()) for name, tensor in adapter]
    poisoned[len(adapter) // 2][1][0, 1] = float("nan")
    run = await _call(stack, "create_run", "nan-lora", lora_rank=4, target_modules=["q_proj", "v_proj"])
    try:
        assert (await _call(stack, "update_weights", adapter, run_id=run.run_id)).policy_version == 1
        loads = len(stack["loads"].loads)
        with pytest.raises(InvalidRequest, match="holds NaN or infinite values") as refused:
            await _call(stack, "update_weights", poisoned, run_id=run.run_id)
        assert refused.value.field == f"tensors[{bad_name}]"
        assert (await _call(stack, "get_run", run.run_id)).policy_version == 1  # version 1 still live
        assert len(stack["loads"].loads) == loads  # the generator was never handed it

        config = AdapterConfig(4, 4.0, ("q_proj", "v_proj"))  # straight to the generator, as a trainer might
        async with grpc.aio.insecure_channel(stack["generator"]) as channel:
            call = generation_pb2_grpc.GenerationServiceStub(channel).LoadAdapter(
                _aiter(adapter_chunks("direct", config, dict(poisoned), batch=True)), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as direct:
                await call
        assert direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert direct.value.details().startswith(f"tensors[{bad_name}]: holds NaN or infinite values")
        assert "direct" not in stack["engine"].adapters.live() and len(stack["loads"].loads) == loads
    finally:
        await _call(stack, "delete_run", run.run_id)


async def _aiter(items):
    for item in items:
        yield item

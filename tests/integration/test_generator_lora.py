"""LoRA adapters on the generator's engines (vLLM on CPU and the HF fallback; SmolLM2-135M in float32).

Adapters are built here with peft (q_proj/v_proj, A and B drawn from a seeded generator so that they change the
model's answers) and loaded from memory under a name. Greedy samples with adapter A, adapter B and none are the
tokens HF + peft picks with the same adapter, and their log-probs match HF + peft's on those tokens; a new version
of A changes A only; a bad adapter is refused and the old one keeps serving; more adapters than vLLM's slots
(``max_loras`` 2, ``max_cpu_loras`` 2) all sample, evicted ones rebuilt from the tensors the engine keeps (also
with a scaling of 1, where it keeps them uncopied); an
unloaded adapter is gone (not listed, refused by name) while another samples as before, and unloading it again is
no error.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from fastexp.sampling import SamplingOptions
from services.common.errors import InvalidRequest
from services.common.generation import CompletionRecord, GenerationRequest
from services.common.lora import AdapterConfig

pytestmark = pytest.mark.smollm2

PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 16
CONFIG = AdapterConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
#: vLLM's CPU kernels against HF's on the same float32 weights (observed differences are ~1e-4)
LOG_PROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """HF + peft on the base model in float32, adapters added by name: what the engines must reproduce."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    model = get_peft_model(base, _lora_config(CONFIG), adapter_name="scratch")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return {"model": model, "prompt": tokenizer.encode(PROMPT, add_special_tokens=False), "loaded": set(), "greedy": {}}


def _lora_config(config: AdapterConfig):
    from peft import LoraConfig

    return LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                      lora_dropout=0.0)


def make_adapter(reference, seed: int, config: AdapterConfig = CONFIG) -> dict[str, torch.Tensor]:
    """An adapter's tensors as peft's get_peft_model_state_dict names them, A and B drawn with ``seed``."""
    from peft import get_peft_model_state_dict

    model = reference["model"]
    name = f"seed{seed}-r{config.rank}"
    if name not in reference["loaded"]:
        model.add_adapter(name, _lora_config(config))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if f".{name}." in parameter_name:  # lora_A (rank, in) and lora_B (out, rank) of this adapter
                    parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        reference["loaded"].add(name)
    return {k: v.clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def reference_greedy(reference, seed: int | None) -> tuple[list[int], torch.Tensor]:
    """HF + peft greedy tokens (EOS ignored) and their log-probs, with adapter ``seed`` (None: the base)."""
    if seed not in reference["greedy"]:
        reference["greedy"][seed] = _greedy_forwards(reference, seed)
    return reference["greedy"][seed]


def _greedy_forwards(reference, seed: int | None) -> tuple[list[int], torch.Tensor]:
    model, tokens = reference["model"], []
    context = model.disable_adapter() if seed is None else contextlib.nullcontext()
    if seed is not None:
        model.set_adapter(f"seed{seed}-r{CONFIG.rank}")
    log_probs = []
    with context, torch.inference_mode():
        out = model(input_ids=torch.tensor([reference["prompt"]]), use_cache=True)
        for _ in range(NEW_TOKENS):
            logits = out.logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            log_probs.append(torch.log_softmax(logits, -1)[tokens[-1]])
            out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(log_probs)


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
async def engine(request, smollm2_path):
    """One engine per backend for the module: vLLM with 2 adapter slots and 2 built adapters kept. vLLM's engine
    runs apart (``AsyncLLM``, what GPU hosts run; the services' own tests run it in process): in process it would
    take over this test process's torch (``torch.set_num_threads`` made a no-op for the tests after it)."""
    if request.param == "vllm":
        from services.generator.vllm_engine import VLLMEngine

        started = VLLMEngine.start(smollm2_path, dtype="float32", max_model_len=512, engine_process="separate",
                                   kv_cache_memory_bytes=256 * 1024**2, max_loras=2, max_cpu_loras=2)
    else:
        from services.generator.hf_engine import HFEngine

        started = HFEngine.start(smollm2_path, dtype="float32", max_model_len=512, max_batch_size=4)
    yield started
    await started.close()


async def greedy(engine, reference, adapter: str | None) -> CompletionRecord:
    request = GenerationRequest(
        request_id=f"greedy-{adapter}", prompts=(tuple(reference["prompt"]),), n_samples_per_prompt=1,
        sampling=SamplingOptions(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    async with contextlib.aclosing(engine.generate(request, adapter=adapter)) as records:
        return [record async for record in records][0]


def assert_sampled_as(record: CompletionRecord, reference, seed: int | None) -> None:
    tokens, log_probs = reference_greedy(reference, seed)
    assert list(record.output_token_ids) == tokens
    torch.testing.assert_close(torch.from_numpy(record.output_log_probs), log_probs, atol=LOG_PROB_TOLERANCE, rtol=0)


async def test_adapters_sample_as_peft_does(engine, reference):
    assert await engine.load_adapter("a", CONFIG, make_adapter(reference, seed=1)) == 1
    assert await engine.load_adapter("b", CONFIG, make_adapter(reference, seed=2)) == 1
    a, b, base = await asyncio.gather(greedy(engine, reference, "a"), greedy(engine, reference, "b"),
                                      greedy(engine, reference, None))
    assert_sampled_as(a, reference, 1)
    assert_sampled_as(b, reference, 2)
    assert_sampled_as(base, reference, None)
    assert len({a.output_token_ids, b.output_token_ids, base.output_token_ids}) == 3
    assert (a.policy_version, b.policy_version, base.policy_version) == (1, 1, 0)


async def test_a_new_version_changes_its_adapter_only(engine, reference):
    await engine.load_adapter("c", CONFIG, make_adapter(reference, seed=3))
    await engine.load_adapter("d", CONFIG, make_adapter(reference, seed=4))
    running = asyncio.ensure_future(greedy(engine, reference, "c"))  # takes version 1 before the load below
    assert await engine.load_adapter("c", CONFIG, make_adapter(reference, seed=5), version=7) == 7
    old = await running
    assert old.policy_version == 1
    assert_sampled_as(old, reference, 3)  # a request started before the update finishes on what it had
    new, other = await asyncio.gather(greedy(engine, reference, "c"), greedy(engine, reference, "d"))
    assert new.policy_version == 7
    assert_sampled_as(new, reference, 5)
    assert_sampled_as(other, reference, 4)


@pytest.mark.parametrize(("change", "field"), [
    ("shape", "tensors[base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight]"),
    ("name", "tensors[base_model.model.model.layers.3.mlp.up_proj.lora_A.weight]"),
    ("rank", "config.rank"),
])
async def test_a_bad_adapter_is_refused_and_the_old_one_serves(engine, reference, change, field):
    name = f"kept-{change}"
    await engine.load_adapter(name, CONFIG, make_adapter(reference, seed=6))
    config, tensors = CONFIG, make_adapter(reference, seed=7)
    if change == "shape":
        tensors["base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight"] = torch.zeros(192, 4)
    elif change == "name":
        tensors["base_model.model.model.layers.3.mlp.up_proj.lora_A.weight"] = torch.zeros(8, 576)
    else:
        config = AdapterConfig(rank=32, alpha=16.0, target_modules=CONFIG.target_modules)
    with pytest.raises(InvalidRequest) as raised:
        await engine.load_adapter(name, config, tensors)
    assert raised.value.field == field
    record = await greedy(engine, reference, name)
    assert record.policy_version == 1
    assert_sampled_as(record, reference, 6)


async def test_more_adapters_than_slots_all_sample(engine, reference):
    names = [f"many-{seed}" for seed in (8, 9, 10)]
    for seed, name in zip((8, 9, 10), names, strict=True):
        await engine.load_adapter(name, CONFIG, make_adapter(reference, seed=seed))
    # vLLM: loading the third evicted the first from its 2-entry cache; sampling with all three rebuilds the evicted
    records = await asyncio.gather(*(greedy(engine, reference, name) for name in [*names, None]))
    for record, seed in zip(records, (8, 9, 10, None), strict=True):
        assert_sampled_as(record, reference, seed)


async def test_adapters_of_scaling_one_evicted_and_rebuilt_sample_as_peft_does(engine, reference):
    # alpha = rank: vLLM folds no scaling into lora_B, so the engine keeps the tensors it was given uncopied
    # (vllm_worker._lora_model); the first, evicted by the third and rebuilt from them, still samples as peft does
    config = AdapterConfig(rank=CONFIG.rank, alpha=float(CONFIG.rank), target_modules=CONFIG.target_modules)
    seeds = (21, 22, 23)  # seeds no other test uses: the reference keeps one peft adapter per seed and rank
    for seed in seeds:
        await engine.load_adapter(f"unscaled-{seed}", config, make_adapter(reference, seed=seed, config=config))
    records = await asyncio.gather(*(greedy(engine, reference, f"unscaled-{seed}") for seed in seeds))
    for record, seed in zip(records, seeds, strict=True):
        assert_sampled_as(record, reference, seed)


async def test_an_unknown_adapter_is_an_invalid_request(engine, reference):
    with pytest.raises(InvalidRequest, match="no adapter named 'nobody'"):
        await greedy(engine, reference, "nobody")


async def test_adapters_serve_on_after_a_full_weight_update(engine, reference, smollm2_path):
    """A base-weight update drops vLLM's built adapters (``reset_lora_state``) and wraps the HF model's layers in
    peft's: the same checkpoint loaded again, an adapter samples as before (rebuilt from the kept tensors)."""
    await engine.load_adapter("after-update", CONFIG, make_adapter(reference, seed=11))
    await engine.update_weights("checkpoint", smollm2_path)
    adapted, base = await asyncio.gather(greedy(engine, reference, "after-update"), greedy(engine, reference, None))
    assert_sampled_as(adapted, reference, 11)
    assert_sampled_as(base, reference, None)


@pytest.fixture(scope="module")
async def stub(engine):
    """The generator service in process on port 0 over the module's engine (which outlives it)."""
    import grpc

    from fastexp.v1 import generation_pb2_grpc
    from services.generator.server import start_generator
    from services.generator.settings import GeneratorSettings

    running = await start_generator(GeneratorSettings(port=0, max_model_len=512), engine)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    await channel.close()
    await running.stop(1)


async def grpc_greedy(stub, reference, adapter: str):
    from fastexp.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        prompts=[generation_pb2.GenerationPrompt(token_ids=generation_pb2.TokenIds(ids=reference["prompt"]))],
        n_samples_per_prompt=1, adapter=adapter,
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
    )
    return [c async for r in stub.Generate(request, timeout=120) for c in r.completions][0]


async def test_load_adapter_streams_chunks_and_generate_takes_its_name(stub, reference):
    import grpc

    from fastexp.tensor_codec import to_numpy
    from fastexp.v1 import generation_pb2
    from services.common.weights.wire import adapter_chunks

    tensors = make_adapter(reference, seed=12)
    with pytest.raises(grpc.aio.AioRpcError) as raised:  # the digest is the sender's: bounded, not interpreted
        await stub.LoadAdapter(adapter_chunks("wired", CONFIG, tensors, weights_digest="x" * 129))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("header.weights_digest: ")
    digest = "sha256:" + "ab" * 32
    answer = await stub.LoadAdapter(adapter_chunks("wired", CONFIG, tensors, version=3, weights_digest=digest,
                                                   chunk_bytes=4096))
    assert (answer.name, answer.version, answer.num_tensors) == ("wired", 3, len(tensors))
    assert answer.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info.max_lora_rank == 16
    assert generation_pb2.AdapterVersion(name="wired", version=3, weights_digest=digest) in info.adapters
    completion = await grpc_greedy(stub, reference, "wired")
    assert completion.policy_version == 3
    record = CompletionRecord(0, 0, (), tuple(completion.output_token_ids),
                              to_numpy(completion.output_log_probs).copy(), "length", "", 3)
    assert_sampled_as(record, reference, 12)


async def test_a_corrupted_or_misshapen_stream_is_refused_naming_the_tensor(stub, reference):
    import grpc

    from services.common.weights.wire import adapter_chunks

    await stub.LoadAdapter(adapter_chunks("guarded", CONFIG, make_adapter(reference, seed=13)))
    messages = list(adapter_chunks("guarded", CONFIG, make_adapter(reference, seed=14), chunk_bytes=4096))
    corrupted = [*messages]
    corrupted[5].tensor.data = bytes(len(corrupted[5].tensor.data))  # zeroed bytes: the CRC-32 no longer matches
    misshapen = make_adapter(reference, seed=14)
    misshapen["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 576)
    for stream, reason in ((corrupted, "CRC-32"), (adapter_chunks("guarded", CONFIG, misshapen), "shape (4, 576)")):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.LoadAdapter(iter(stream))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensors[base_model.model." in raised.value.details() and reason in raised.value.details()
    completion = await grpc_greedy(stub, reference, "guarded")
    assert completion.policy_version == 1
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await grpc_greedy(stub, reference, "nobody")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unload_adapter_frees_one_and_the_other_samples_as_before(stub, reference):
    import grpc

    from fastexp.tensor_codec import to_numpy
    from fastexp.v1 import generation_pb2
    from services.common.weights.wire import adapter_chunks

    for name, seed in (("staying", 15), ("leaving", 16)):
        await stub.LoadAdapter(adapter_chunks(name, CONFIG, make_adapter(reference, seed=seed)))
    before = await grpc_greedy(stub, reference, "staying")
    answer = await stub.UnloadAdapter(generation_pb2.UnloadAdapterRequest(name="leaving"))
    assert (answer.name, answer.unloaded) == ("leaving", True)
    listed = {a.name for a in (await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())).adapters}
    assert "staying" in listed and "leaving" not in listed
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await grpc_greedy(stub, reference, "leaving")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("adapter: no adapter named 'leaving'")
    after = await grpc_greedy(stub, reference, "staying")
    assert list(after.output_token_ids) == list(before.output_token_ids)
    torch.testing.assert_close(torch.from_numpy(to_numpy(after.output_log_probs).copy()),
                               torch.from_numpy(to_numpy(before.output_log_probs).copy()), atol=1e-5, rtol=0)
    again = await stub.UnloadAdapter(generation_pb2.UnloadAdapterRequest(name="leaving"))
    assert (again.name, again.unloaded) == ("leaving", False)  # idempotent: a retried delete succeeds
    for malformed in ("", "../etc", "x" * 257):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.UnloadAdapter(generation_pb2.UnloadAdapterRequest(name=malformed))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("name: ")

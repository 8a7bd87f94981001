"""Multi-turn episodes end to end, in process on real services: SmolLM2 (HF backend) answering reasoning-gym
arithmetic in the scorer's ``math_feedback`` environment. The rows are token-exact: every token the generator
sampled in each turn appears unchanged, ``action_mask`` is 1 on exactly those tokens, the observations between
turns are the chat template's rendering of the environment's feedback, and the streamed ``action_log_probs`` equal
an independent forward of the whole sequence. An environment service killed mid-stream costs only the groups
whose episodes it held: they are reported, nothing is delivered twice."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastexp import Sampling
from fastexp.request import RequestOptions, build_request
from fastexp.types import turn_spans
from fastexp.v1 import experience_pb2_grpc
from fastexp.wire import experience_from_pb
from services.demo.datasets import task_problems
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.inprocess import Recording

pytestmark = [pytest.mark.smollm2]

PROBLEMS = task_problems("basic_arithmetic", 4, seed=3)
OPTIONS = RequestOptions(
    n_samples_per_prompt=2, sampling=Sampling(temperature=1.0, max_new_tokens=64, seed=11), environment="math_feedback",
    max_turns=3, micro_rollout_batch_size=2, kl_coef=0.0,
)



@pytest.fixture(scope="module")
async def stack(smollm2_path):
    engine = HFEngine.start(smollm2_path, dtype="float32", max_model_len=1024, max_batch_size=8)
    recording = Recording(engine)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=1024), engine)
    scorer_settings = ScorerSettings(port=0, environment_workers=1)
    core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, core)
    experience = await start_experience(ExperienceSettings(
        port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=smollm2_path, reference_model=smollm2_path, dtype="float32", environment_step_timeout_s=30,
    ))
    await experience.wait_ready(120)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{experience.running.port}")
    yield {"stub": experience_pb2_grpc.ExperienceServiceStub(channel), "recording": recording, "scorer": scorer,
           "core": core, "scorer_settings": scorer_settings.model_copy(update={"port": scorer.port})}
    await channel.close()
    await experience.running.stop(1)
    await experience.close()
    await generator.stop(1)
    await core.context.close()


async def _stream(stub, options=OPTIONS, on_batch=None):
    request = build_request([list(p.messages) for p in PROBLEMS], options,
                            references=[p.reference for p in PROBLEMS])
    call = stub.MakeExperiences(request, timeout=600)
    batches = []
    async for message in call:
        batches.append(experience_from_pb(message))
        if on_batch is not None:
            await on_batch(len(batches))
    return batches, dict(await call.trailing_metadata())


async def test_episodes_are_token_exact_and_their_log_probs_are_the_actors(stack, smollm2_path):
    batches, trailers = await _stream(stack["stub"])
    assert trailers["fastexp-failed-groups"] == "0"
    rows = [(e, r) for e in batches for r in range(len(e.reward))]
    assert sorted((e.prompt_index[r], e.sample_index[r]) for e, r in rows) == [(p, s) for p in range(4) for s in range(2)]
    assert any(e.num_turns[r] > 1 for e, r in rows), "some episode took several turns"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    sampled = {(tuple(c.prompt_token_ids), tuple(c.output_token_ids)): c for c in stack["recording"].completions}
    for e, r in rows:
        width = e.sequences.shape[1] - e.action_mask.shape[1]  # prompts are left-padded to this width
        real = e.attention_mask[r].bool()
        sequence, prompt_length = e.sequences[r], int(real[:width].sum())
        spans = turn_spans(e.action_mask[r])
        assert len(spans) == e.num_turns[r]
        texts = []
        for start, end in spans:  # each turn: exactly a completion the generator sampled from the sequence so far
            context = tuple(sequence[real][: prompt_length + start].tolist())
            turn = tuple(sequence[width + start : width + end].tolist())
            assert (context, turn) in sampled, f"row {r}: turn tokens {turn[:8]}... not sampled from that context"
            texts.append(sampled[(context, turn)].text)
        model_tokens = sequence[width:][e.action_mask[r]].tolist()
        # response texts keep special tokens (skip_special_tokens defaults to False, as in the seed)
        assert tokenizer.decode(model_tokens, skip_special_tokens=False) == "".join(texts)
        for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False):  # observations: the template's
            observation = tokenizer.decode(sequence[width + end : width + next_start].tolist())
            assert observation.startswith("\n<|im_start|>user\n") and observation.endswith("<|im_start|>assistant\n")
            assert "\\boxed{}" in observation
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for e, r in rows[:4]:
        width = e.sequences.shape[1] - e.action_mask.shape[1]
        real = e.attention_mask[r].bool()
        ids = e.sequences[r][real].unsqueeze(0)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        prompt_length = int(real[:width].sum())
        length = int(e.response_length[r])
        positions = torch.arange(prompt_length - 1, prompt_length - 1 + length)
        expected = torch.log_softmax(logits[positions], dim=-1).gather(-1, ids[0, positions + 1].unsqueeze(-1))[:, 0]
        mask = e.action_mask[r][:length]
        torch.testing.assert_close(e.action_log_probs[r][:length][mask], expected[mask], atol=2e-3, rtol=0)


async def test_an_environment_service_killed_mid_stream_costs_only_its_groups(stack):
    restarted = {}

    async def kill_after_first_batch(count: int) -> None:
        if count == 1:
            await stack["scorer"].stop(0)  # every open episode's session is gone with it
            restarted["core"] = build_scorer(stack["scorer_settings"])  # a new container at the same address
            restarted["scorer"] = await start_scorer(stack["scorer_settings"], restarted["core"])

    batches, trailers = await _stream(stack["stub"], on_batch=kill_after_first_batch)
    delivered = Counter(i for e in batches for i in e.prompt_index)
    failed = [int(i) for i in trailers.get("fastexp-failed-prompt-indices", "").split(",") if i]
    assert all(count == 2 for count in delivered.values()), "no group delivered twice or partly"
    assert sorted([*delivered, *failed]) == [0, 1, 2, 3] and not set(delivered) & set(failed)
    assert int(trailers["fastexp-failed-groups"]) == len(failed)
    await restarted["scorer"].stop(0)
    await restarted["core"].close()

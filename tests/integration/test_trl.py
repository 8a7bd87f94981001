"""TRL trains on fastexp's rollouts (client/fastexp/integrations/trl.py), against the real services in process (HF
backend, the tiny Llama in float32) and TRL 1.16.0's own trainer, sampler, queue and sample types.

- ``GRPOTrainer(rollout_func=FastexpRollout(...), reward_funcs=[fastexp_reward])`` runs real optimizer steps on
  the CPU: every row TRL trains on is one the generator sampled (same prompt and completion tokens, in the slice's
  order), the trainer's weights reach the generator before each step's rollouts (its policy version advances, the
  engine's weights equal the trainer's, the rows carry the new version), and the rewards TRL optimizes are the
  scorer's (its rule, with the reference looked up by prompt).
- ``FastexpRolloutWorker`` / ``FastexpWeightTransfer`` match TRL's async protocols member for member; driven as
  ``AsyncGRPOTrainer`` drives them (cold sync, start, syncs, stop), the worker's ``RolloutSample`` s carry the
  trainer's versions and fastexp's group advantages, and TRL's ``RolloutQueueDataset`` drops the stale ones.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import defaultdict

import grpc
import numpy as np
import pytest
import torch

from fastexp import RequestOptions, Sampling
from fastexp.integrations.trl import (
    FastexpRollout,
    FastexpRolloutWorker,
    FastexpWeightTransfer,
    experience_rows,
    fastexp_reward,
    policy_weights,
    prompt_runs,
)
from fastexp.types import Experience
from fastexp.v1 import generation_pb2, generation_pb2_grpc
from services.experience.server import start_experience
from services.experience.settings import ExperienceSettings
from services.generator.hf_engine import HFEngine
from services.generator.server import start_generator
from services.generator.settings import GeneratorSettings
from services.scorer.server import build_scorer, start_scorer
from services.scorer.settings import ScorerSettings
from tests.support.inprocess import Recording

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

# the scorer's rule: len(response) / 10 + len(reference) (tests/support/reward_plugins.py)
RULE = "tests.support.reward_plugins:length_and_reference_reward"
PROBLEMS = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b) * (1 + a % 3)}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]]



@pytest.fixture(scope="module")
async def stack(tiny_model_path):
    engine = HFEngine.start(tiny_model_path, dtype="float32", max_model_len=256, max_batch_size=8)
    recording = Recording(engine)
    generator = await start_generator(GeneratorSettings(port=0, max_model_len=256), engine)
    scorer_settings = ScorerSettings(port=0, sources=[{"type": "rule", "name": "rule", "function": RULE, "workers": 1}])
    scorer_core = build_scorer(scorer_settings)
    scorer = await start_scorer(scorer_settings, scorer_core)
    experience = await start_experience(ExperienceSettings(
        port=0, generator_address=f"127.0.0.1:{generator.port}", scorer_address=f"127.0.0.1:{scorer.port}",
        actor_model=tiny_model_path, reference_model=tiny_model_path, dtype="float32",
    ))
    await experience.wait_ready(60)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{generator.port}")
    yield {"address": f"127.0.0.1:{experience.running.port}", "engine": engine, "recording": recording,
           "generator": generation_pb2_grpc.GenerationServiceStub(channel)}
    await channel.close()
    await experience.running.stop(1)
    await experience.close()
    await scorer.stop(1)
    await scorer_core.close()
    await generator.stop(1)
    await engine.close()


async def _version(stack) -> int:
    return (await stack["generator"].GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)).policy_version


def _policy(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_prompt_runs_are_the_groups_of_the_slice():
    assert prompt_runs(["a", "a", "b", "b", "a"]) == [(0, 2), (2, 2), (4, 1)]
    chat = [{"role": "user", "content": "x"}]
    assert prompt_runs([chat, list(chat), chat, "x"]) == [(0, 3), (3, 1)]
    assert prompt_runs([]) == []


def test_experience_rows_are_unpadded_with_the_models_tokens_marked():
    """Row 0: a two-turn episode (prompt [5, 6] left-padded to 3; response 7 | 8 | 9: 8 an observation); row 1: a
    one-token single-turn response. P = 3, A = 4."""
    zeros = torch.zeros(2, 4)
    experience = Experience(
        sequences=torch.tensor([[0, 5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 0, 0, 0]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]]),
        action_mask=torch.tensor([[True, False, True, False], [True, False, False, False]]),
        action_log_probs=zeros, base_action_log_probs=None, values=None, returns=zeros,
        advantages=torch.tensor([[0.5, 0.5, 0.5, 0.0], [-0.5, 0.0, 0.0, 0.0]]), kl=None,
        reward=torch.tensor([1.0, 0.0]), response_length=torch.tensor([3, 1]), total_length=torch.tensor([5, 4]),
        prompt_index=(0, 0), sample_index=(0, 1), prompt_texts=("p", "p"), response_texts=("a", "b"),
        policy_version=(3, 3), reward_metrics={"rule/chars": torch.tensor([1.0, 2.0])}, kl_coef=0.0, batch_index=0,
        rollout_log_probs=torch.tensor([[-0.1, -9.0, -0.3, 0.0], [-0.4, 0.0, 0.0, 0.0]]), shaped_reward=zeros[:, 0],
    )
    first, second = experience_rows(experience)
    assert (first.prompt_ids, first.completion_ids, first.env_mask) == ([5, 6], [7, 8, 9], [1, 0, 1])
    assert first.logprobs == pytest.approx([-0.1, 0.0, -0.3])  # 0 on the observation token
    assert (first.reward, first.advantage, first.policy_version, first.reward_metrics) == (1.0, 0.5, 3, {"rule/chars": 1.0})
    assert (second.prompt_ids, second.completion_ids, second.env_mask, second.sample_index) == ([1, 2, 3], [4], [1], 1)
    assert second.logprobs == pytest.approx([-0.4]) and second.advantage == -0.5


def test_policy_weights_of_a_lora_model_are_its_merged_layers(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(_policy(tiny_model_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # a trained adapter: B != 0
    sent = dict(policy_weights(policy))
    assert sorted(sent) == sorted(f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj"))
    merged = policy.merge_and_unload().state_dict()  # PEFT's own merge is the reference
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name])
    plain = _policy(tiny_model_path)
    assert [name for name, _ in policy_weights(plain)] == [name for name, _ in plain.named_parameters()]


async def test_grpo_trainer_trains_on_fastexp_rollouts(stack, tiny_model_path, tmp_path):
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = _policy(tiny_model_path)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine_weights = dict(stack["engine"]._model.named_parameters())
    dataset = datasets.Dataset.from_list(PROBLEMS)
    v0 = await _version(stack)
    seen = []  # per step: what TRL handed its reward functions, and whether the generator had the trainer's weights

    def recorded(prompts, completions, completion_ids, **kwargs):
        """A second reward function (weight 0): records what TRL passes and checks the generator's weights."""
        same = all(torch.equal(engine_weights[name], p) for name, p in model.named_parameters())
        moved = any(not torch.equal(initial[name], p) for name, p in model.named_parameters())
        seen.append({"prompts": prompts, "completion_ids": completion_ids, "same_weights": same, "moved": moved,
                     **{key: kwargs[key] for key in ("reward", "policy_version", "reward_metrics", "answer")}})
        return [0.0] * len(prompts)

    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
        max_steps=3, learning_rate=1e-3, beta=0.0, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, reward_weights=[1.0, 0.0], seed=0, disable_tqdm=True,
    )
    with FastexpRollout(stack["address"], dataset=dataset) as rollout:
        trainer = GRPOTrainer(model=model, reward_funcs=[fastexp_reward, recorded], args=args, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=rollout)
        await asyncio.to_thread(trainer.train)

    assert trainer.state.global_step == 3 and len(seen) == len(rollout.calls) == 3
    # weights reach the generator after each step, and the next rows carry the new version
    assert [call.pushed_policy_version for call in rollout.calls] == [None, v0 + 1, v0 + 2]
    assert [set(call.policy_versions) for call in rollout.calls] == [{v0}, {v0 + 1}, {v0 + 2}]
    assert [step["policy_version"] for step in seen] == [list(call.policy_versions) for call in rollout.calls]
    assert [step["same_weights"] for step in seen] == [True, True, True]  # the engine has the trainer's weights
    assert [step["moved"] for step in seen] == [False, True, True]  # ... and they are the trained ones
    assert await _version(stack) == v0 + 2
    # rows come from the generator, each group's completions in the slice (TRL repeats each prompt twice)
    sampled = defaultdict(list)
    for record in stack["recording"].completions:
        sampled[tuple(record.output_token_ids)].append(record)
    reference = {p["prompt"][0]["content"]: p["answer"] for p in PROBLEMS}
    logged = [row["rewards/fastexp_reward/mean"] for row in trainer.state.log_history if "loss" in row]
    for step in seen:
        assert [n for _, n in prompt_runs(step["prompts"])] == [2, 2]
        assert step["answer"] == [reference[p[0]["content"]] for p in step["prompts"]]
        for prompt, completion, reward, metrics in zip(
                step["prompts"], step["completion_ids"], step["reward"], step["reward_metrics"], strict=True):
            content = prompt[0]["content"]
            [record] = [r for r in sampled[tuple(completion)] if content in tokenizer.decode(r.prompt_token_ids)]
            # the scorer's reward of this very completion, with the reference looked up by prompt
            assert reward == pytest.approx(len(record.text) / 10 + len(reference[content]), abs=1e-5)
            assert metrics["rule/chars"] == len(record.text) and metrics["rule/reward"] == pytest.approx(reward)
    assert logged == pytest.approx([float(np.mean(step["reward"])) for step in seen], abs=1e-4)
    assert all(not torch.equal(initial[name], p) for name, p in model.named_parameters())  # real optimizer steps


def test_the_worker_and_the_transfer_implement_trls_async_protocols():
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

    for protocol, ours in ((RolloutWorkerProtocol, FastexpRolloutWorker), (WeightTransferProtocol, FastexpWeightTransfer)):
        members = [name for name in vars(protocol) if not name.startswith("_")]
        assert members, protocol
        for name in members:
            assert callable(getattr(ours, name)), (ours.__name__, name)
            expected = list(inspect.signature(getattr(protocol, name)).parameters)
            assert list(inspect.signature(getattr(ours, name)).parameters) == expected, (ours.__name__, name)
        for name in getattr(protocol, "__annotations__", {}):  # rollout_buffer, metrics_queue
            assert "queue.Queue" in str(protocol.__annotations__[name])
            assert name in inspect.getsource(ours.__init__), (ours.__name__, name)


async def test_async_worker_and_transfer_driven_as_async_grpo_trainer_drives_them(stack, tiny_model_path):
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    policy = _policy(tiny_model_path)
    options = RequestOptions(n_samples_per_prompt=2, sampling=Sampling(temperature=1.0, max_new_tokens=8),
                             advantage_estimator="group_norm", kl_coef=0.0, skip_actor_forward=True, max_staleness=1)
    transfer = FastexpWeightTransfer(stack["address"])
    worker = FastexpRolloutWorker(stack["address"], PROBLEMS[:4], options, prompts_per_request=2, queue_maxsize=4,
                                  weight_transfer=transfer)
    trainer_version = 0

    def sync():  # AsyncGRPOTrainer._sync_weight_merged, main process
        nonlocal trainer_version
        transfer.pause()
        transfer.send_weights((name, p.detach()) for name, p in policy.named_parameters())
        transfer.resume()
        trainer_version += 1
        worker.update_model_version(trainer_version)

    def drive():
        transfer.init_weight_transfer()  # _TrainBeginCallback: init, cold sync, then start
        sync()
        worker.start()
        first = [worker.rollout_buffer.get(timeout=120) for _ in range(4)]
        worker.check_health(60)
        deadline = time.monotonic() + 120
        while not worker.rollout_buffer.full() and time.monotonic() < deadline:  # backpressure: 4 queued, no more
            time.sleep(0.05)
        sync()  # the trainer's next version: the queued version-1 samples are one version old
        metrics = defaultdict(list)
        dataset = RolloutQueueDataset(worker.rollout_buffer, model_version_fn=lambda: trainer_version,
                                      check_health_fn=worker.check_health, stale_after_s=120, metrics=metrics,
                                      max_staleness=0, poll_interval_s=0.5)
        fresh = [item for item, _ in zip(dataset, range(4), strict=False)]
        worker.stop()
        worker.check_health(60)  # a stopped worker is healthy
        transfer.destroy()
        drained = []
        while not worker.metrics_queue.empty():
            drained.append(worker.metrics_queue.get_nowait())
        return first, fresh, metrics, drained

    v0 = await _version(stack)
    first, fresh, metrics, drained = await asyncio.to_thread(drive)
    assert transfer.policy_version == v0 + 2 == await _version(stack)
    for sample in first:
        assert isinstance(sample, RolloutSample) and sample.model_version == 1 and sample.enqueued_at is not None
        n = len(sample.input_ids)
        assert sample.input_ids.dtype == np.int64 and sample.completion_mask.shape == sample.old_log_probs.shape == (n,)
        prompt = int((sample.completion_mask == 0).sum())
        assert sample.completion_mask[prompt:].all() and not sample.old_log_probs[:prompt].any()
        assert (sample.old_log_probs[prompt:] <= 0).all() and sample.prompt in [p["prompt"] for p in PROBLEMS[:4]]
        assert sample.completion[0]["role"] == "assistant"
        assert sample.metrics["reward"] == pytest.approx(len(sample.completion[0]["content"]) / 10 + len(
            next(p["answer"] for p in PROBLEMS if p["prompt"] == sample.prompt)), abs=1e-5)
    groups = defaultdict(list)
    for sample in first:
        groups[sample.group_id].append(sample)
    for members in groups.values():  # fastexp's group_norm advantages: (r - mean) / std within the group
        if len(members) == 2:
            rewards = [m.metrics["reward"] for m in members]
            if rewards[0] != rewards[1]:
                assert sorted(m.advantage for m in members) == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    # TRL's queue semantics: with max_staleness 0, samples of the previous version are dropped, only fresh ones kept
    assert len(fresh) == 4 and all(set(item) >= {"input_ids", "completion_mask", "old_log_probs", "advantage",
                                                 "group_id", "metrics"} for item in fresh)
    assert max(metrics["sample/staleness_max"]) == 0.0
    assert sum(metrics["sample/dropped_stale_total"]) >= 1  # the queue held version-1 samples when version 2 came
    assert drained and any("fastexp/policy_version" in item for item in drained)

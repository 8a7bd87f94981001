"""Actor/reference/critic forwards on a real (tiny) Llama: packed and shared-prompt rows equal padded rows; critic
checkpoints load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastexp.critic import save_value_model
from fastexp.packing import pack_experience, unpack_experience
from fastexp.types import Experience
from services.common.generation import CompletionRecord
from services.experience.config import PromptSpec
from services.experience.workers.critic import ValueModel, init_critic
from services.experience.workers.inputs import chunks
from services.experience.workers.logprobs import LogProbModel
from services.experience.workers.sequences import build_rollout

PAD = 2


def _rollout():
    """Mixed prompt and response lengths, including an empty response."""
    prompts = [(11, 12, 13, 14, 15), (21, 22), (31, 32, 33)]
    responses = [(101, 102), (201, 202, 203, 204, 205, 206), ()]
    specs = tuple(PromptSpec(f"p{i}", p, "", "") for i, p in enumerate(prompts))
    records = [
        CompletionRecord(i, 0, prompts[i], r, np.zeros(len(r), np.float32), "stop", "x", 0)
        for i, r in enumerate(responses)
    ]
    return build_rollout(records, specs, PAD)


def _group_rollout():
    """Two prompt groups of three samples (rows of a group consecutive), one with an empty response."""
    prompts = [(11, 12, 13, 14, 15), (21, 22, 23)]
    responses = [[(101, 102), (103,), (104, 105, 106, 107)], [(201, 202, 203), (), (204, 205)]]
    specs = tuple(PromptSpec(f"p{i}", p, "", "") for i, p in enumerate(prompts))
    records = [
        CompletionRecord(i, s, prompts[i], r, np.zeros(len(r), np.float32), "stop", "x", 0)
        for i, group in enumerate(responses) for s, r in enumerate(group)
    ]
    return build_rollout(records, specs, PAD)


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    return LogProbModel.load(tiny_model_path, dtype="float32", device="cpu")


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_packed_forward_equals_padded_forward(actor, micro_batch_size):
    rollout = _rollout()
    mask = rollout.action_mask
    padded, padded_entropy = actor.action_log_probs(chunks(rollout, micro_batch_size, packed=False), True)
    packed, packed_entropy = actor.action_log_probs(chunks(rollout, micro_batch_size, packed=True), True)
    assert padded.shape == packed.shape == mask.shape
    assert torch.allclose(padded[mask], packed[mask], atol=1e-5)
    assert torch.allclose(padded_entropy[mask], packed_entropy[mask], atol=1e-5)
    assert torch.all(packed[~mask] == 0)
    # entropy is between 0 and log(V) and log-probs are <= 0
    assert torch.all(packed_entropy[mask] >= 0) and torch.all(packed_entropy[mask] <= np.log(49152) + 1e-4)
    assert torch.all(packed[mask] <= 0)


@pytest.mark.parametrize("micro_batch_size", [2, 3, 6])  # 2: a group split across chunks
def test_shared_prompt_forward_equals_padded_forward(actor, micro_batch_size):
    rollout = _group_rollout()
    mask = rollout.action_mask
    padded, padded_entropy = actor.action_log_probs(chunks(rollout, micro_batch_size, packed=False), True)
    parts = chunks(rollout, micro_batch_size, packed=True, share_prompt=True)
    shared, shared_entropy = actor.action_log_probs(parts, True)
    assert torch.allclose(padded[mask], shared[mask], atol=1e-5)
    assert torch.allclose(padded_entropy[mask], shared_entropy[mask], atol=1e-5)
    assert torch.all(shared[~mask] == 0)
    if micro_batch_size == 6:  # each prompt once: 5 + 3 prompt tokens + 7 + 5 response tokens
        assert parts[0].input_ids.shape == (1, 20)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_span_attention_matches_the_dense_mask_through_the_model(actor, tiny_model_path, share_prompt):
    """The loaded actor (SDPA) attends span by span; the same weights on eager attention take the (T, T) mask."""
    from transformers import AutoModelForCausalLM

    from services.experience.workers.attention import SPAN_ATTENTION

    eager = LogProbModel(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32,
                                                              attn_implementation="eager").eval())
    assert actor.module.config._attn_implementation == SPAN_ATTENTION
    assert eager.module.config._attn_implementation == "eager"  # kept: only SDPA models switch
    rollout = _group_rollout()
    parts = chunks(rollout, 6, packed=True, share_prompt=share_prompt)
    spans, spans_entropy = actor.action_log_probs(parts, True)
    dense, dense_entropy = eager.action_log_probs(parts, True)
    mask = rollout.action_mask
    torch.testing.assert_close(spans[mask], dense[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(spans_entropy[mask], dense_entropy[mask], rtol=0, atol=1e-5)


def test_the_spans_reach_every_layer(actor):
    """Given spans, the layers attend by them, not by the mask: under an all-allowing mask plus the spans the logits
    are those of the chunk's own mask; without the spans that mask changes them (so spans that never arrived show)."""
    chunk = chunks(_group_rollout(), 6, packed=True, share_prompt=True)[0]
    model, dtype = actor.module, actor.module.dtype
    inputs = {"input_ids": chunk.input_ids, "position_ids": chunk.position_ids, "use_cache": False}
    allow_all = torch.zeros(chunk.attention_mask.shape, dtype=dtype)
    with torch.inference_mode():
        right = model(**inputs, attention_mask=chunk.model_mask(dtype, "cpu")).logits
        by_spans = model(**inputs, attention_mask=allow_all, fastexp_spans=chunk.spans).logits
        wrong = model(**inputs, attention_mask=allow_all).logits
    torch.testing.assert_close(by_spans, right, rtol=0, atol=1e-5)
    assert (wrong - right).abs().max() > 1e-2


def test_a_sliding_window_model_keeps_sdpa():
    """Span attention reproduces plain causal attention only: a Mistral with a sliding window (shorter than the
    rows) stays on SDPA, and its packed rows, windowed by transformers, equal its padded ones."""
    from transformers import MistralConfig, MistralForCausalLM

    from services.experience.workers.attention import plain_causal

    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4,
                           attn_implementation="sdpa")
    forward = LogProbModel(MistralForCausalLM(config).eval())
    assert forward.module.config._attn_implementation == "sdpa" and not plain_causal(config)
    rollout = _group_rollout()
    packed = forward.action_log_probs(chunks(rollout, 6, packed=True))[0]
    padded = forward.action_log_probs(chunks(rollout, 6, packed=False))[0]
    torch.testing.assert_close(packed[rollout.action_mask], padded[rollout.action_mask], rtol=0, atol=1e-5)


def test_the_service_shares_prompts_only_for_plainly_causal_models(tiny_model_path, tmp_path, caplog):
    """The shared-prompt layout's mask has no sliding window: the service turns prompt sharing off, and says so,
    when a model has one; the tiny Llama keeps it."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from services.experience.server import _load_policy
    from services.experience.settings import ExperienceSettings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    plain = _load_policy(ExperienceSettings(actor_model=tiny_model_path, reference_model=tiny_model_path))
    assert plain.models.share_prompt
    windowed = _load_policy(ExperienceSettings(actor_model=tiny_model_path, reference_model=str(tmp_path)))
    assert not windowed.models.share_prompt
    assert "forward_share_prompt off" in caplog.text


def test_packed_rows_do_not_attend_to_each_other(actor):
    rollout = _rollout()
    alone = actor.action_log_probs(chunks(rollout, 1, packed=True))[0]
    together = actor.action_log_probs(chunks(rollout, 3, packed=True))[0]
    assert torch.allclose(alone, together, atol=1e-5)


def test_critic_checkpoint_round_trip_and_init(tiny_model_path, tmp_path):
    from transformers import AutoModel

    rollout = _rollout()
    backbone = AutoModel.from_pretrained(tiny_model_path, dtype=torch.float32)
    head = torch.nn.Linear(backbone.config.hidden_size, 1, bias=True)
    torch.manual_seed(1)
    torch.nn.init.normal_(head.weight, std=0.5)
    save_value_model(backbone, head, tmp_path / "critic")
    critic = ValueModel.load(str(tmp_path / "critic"), dtype="float32", device="cpu")
    padded = critic.values(chunks(rollout, 2, packed=False))
    packed = critic.values(chunks(rollout, 2, packed=True))
    mask = rollout.action_mask
    assert padded.shape == mask.shape and torch.allclose(padded[mask], packed[mask], atol=1e-5)
    groups = _group_rollout()
    shared = critic.values(chunks(groups, 6, packed=True, share_prompt=True))
    alone = critic.values(chunks(groups, 6, packed=False))
    assert torch.allclose(shared[groups.action_mask], alone[groups.action_mask], atol=1e-5)
    # by hand: V at the hidden state that precedes action j, with the saved head
    with torch.no_grad():
        row = rollout.sequences[1][rollout.attention_mask[1].bool()].unsqueeze(0)
        hidden = backbone(input_ids=row).last_hidden_state[0]
        expected = head(hidden[1:7]).squeeze(-1)  # prompt of 2: actions 0..5 are predicted at positions 1..6
    assert torch.allclose(packed[1, :6], expected, atol=1e-5)
    # an OpenRLHF-style checkpoint (score.* head, causal-LM keys) loads too; a plain LM has no head
    init = init_critic(tiny_model_path, tmp_path / "init", dtype="float32")
    zero = ValueModel.load(str(init), dtype="float32", device="cpu").values(chunks(rollout, 3, packed=False))
    assert torch.all(zero == 0)
    with pytest.raises(ValueError, match="no value head"):
        ValueModel.load(tiny_model_path, dtype="float32", device="cpu")


def test_openrlhf_score_head_checkpoint_loads(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    state = load_file(f"{tiny_model_path}/model.safetensors")
    hidden = AutoConfig.from_pretrained(tiny_model_path).hidden_size
    state["score.weight"] = torch.full((1, hidden), 0.01)
    folder = tmp_path / "openrlhf-critic"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    AutoConfig.from_pretrained(tiny_model_path).save_pretrained(folder)
    values = ValueModel.load(str(folder), dtype="float32", device="cpu").values(chunks(_rollout(), 3, packed=True))
    assert values.shape == (3, 6) and torch.all(values[2] == 0) and torch.any(values[0] != 0)


def test_pack_and_unpack_experience_round_trip():
    rollout = _rollout()
    b, a = rollout.action_mask.shape
    per_action = torch.randn(b, a) * rollout.action_mask
    experience = Experience(
        rollout.sequences, rollout.attention_mask, rollout.action_mask, per_action, per_action * 2, per_action * 3,
        per_action + 1 * rollout.action_mask, per_action - 1 * rollout.action_mask, per_action * 0.5,
        torch.ones(b), rollout.response_length, rollout.total_length, rollout.prompt_index, rollout.sample_index,
        rollout.prompt_texts, rollout.response_texts, rollout.policy_version, {}, 0.1, 0, rollout.rollout_log_probs,
        torch.ones(b), action_entropy=per_action.abs(),
    )
    packed = pack_experience(experience)
    total, actions = int(rollout.total_length.sum()), int(rollout.response_length.sum())
    assert packed.sequences.shape == (1, total) and packed.action_log_probs.shape == (1, actions)
    assert packed.attention_mask[0].tolist() == [1] * 7 + [2] * 8 + [3] * 3
    assert packed.packed_seq_lens.tolist() == [7, 8, 3] and packed.values.shape == (1, actions)
    assert packed.sequences[0, :7].tolist() == [11, 12, 13, 14, 15, 101, 102]
    back = unpack_experience(packed, PAD)
    for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "values", "advantages",
                 "action_entropy", "kl"):
        assert torch.equal(getattr(back, name), getattr(experience, name)), name
    assert back.packed_seq_lens is None and pack_experience(packed) is packed


def test_packing_benchmark_smoke(tiny_model_path):
    """The packing benchmark runs and reports its keys (tiny sizes; no speed threshold in tests)."""
    from benchmarks import packing

    figures = packing.run(tiny_model_path, rows=4, max_response=12, micro_batch_size=2, repeats=1, dtype="float32")
    assert {"packed_vs_padded", "packing_padding_fraction", "packing_max_abs_logprob_diff",
            "span_attention_vs_mask"} <= set(figures)
    assert 0 < figures["packing_padding_fraction"] < 1 and figures["packing_max_abs_logprob_diff"] < 1e-4
    assert figures["span_attention_max_abs_logprob_diff"] < 1e-4  # float32: the same attention, another order


def test_a_device_map_places_the_models_through_accelerate_with_the_same_outputs(tiny_model_path, actor, tmp_path):
    """``device_map`` (the experience service's setting for models larger than one GPU) loads through accelerate's
    placement, here onto the only device there is; log-probs and critic values equal the whole-model ones."""
    mapped = LogProbModel.load(tiny_model_path, dtype="float32", device="cpu", device_map="auto")
    rollout = _rollout()
    expected = actor.action_log_probs(chunks(rollout, 2, packed=True))[0]
    torch.testing.assert_close(mapped.action_log_probs(chunks(rollout, 2, packed=True))[0], expected)
    folder = init_critic(tiny_model_path, tmp_path / "critic", dtype="float32")
    whole = ValueModel.load(str(folder), dtype="float32", device="cpu").values(chunks(rollout, 2, packed=True))
    spread = ValueModel.load(str(folder), dtype="float32", device="cpu", device_map="auto")
    torch.testing.assert_close(spread.values(chunks(rollout, 2, packed=True)), whole)

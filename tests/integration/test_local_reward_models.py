"""Local reward models on real weights: a sequence classifier built here, and all-MiniLM-L6-v2 from its package."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scorer.config import MINILM_ALIAS
from services.scorer.models import LocalModelScorer, SimilarityScorer, resolve_encoder
from services.scorer.scorer import ScoreItem

QUERIES = ["<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\nIt is 5.<|im_end|>",
           "short",
           "a somewhat longer response that needs more tokens than the others do, to exercise padding"]


def as_items(queries):
    return [ScoreItem(q, "", q, "", "") for q in queries]


async def test_sequence_classifier_scores_match_unbatched_forward_passes(reward_model_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    batched = LocalModelScorer("rm", reward_model_path, micro_batch_size=3, max_length=512, dtype="float32",
                               device="cpu")
    single = LocalModelScorer("rm", reward_model_path, micro_batch_size=1, max_length=512, dtype="float32",
                              device="cpu")
    await batched.start()
    await single.start()
    a = await batched.score(as_items(QUERIES))
    b = await single.score(as_items(QUERIES))
    assert a.errors == (None,) * 3
    np.testing.assert_allclose(a.rewards, b.rewards, atol=1e-5)  # right padding does not change a score
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval()
    with torch.inference_mode():
        direct = [model(**tokenizer(q, return_tensors="pt")).logits[0, 0].item() for q in QUERIES]
    np.testing.assert_allclose(a.rewards, direct, atol=1e-5)
    # truncation keeps the end of the query: the last tokens decide the score of a decoder classifier
    truncated = LocalModelScorer("rm", reward_model_path, micro_batch_size=2, max_length=8, dtype="float32",
                                 device="cpu")
    await truncated.start()
    tail = tokenizer(QUERIES[2])["input_ids"][-8:]
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tail])).logits[0, 0].item()
    assert (await truncated.score(as_items(QUERIES[2:]))).rewards[0] == pytest.approx(expected, abs=1e-5)


async def test_a_multi_label_classifier_is_refused(tmp_path, reward_model_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(reward_model_path)
    config.num_labels = 3
    config.save_pretrained(tmp_path)
    scorer = LocalModelScorer("rm3", str(tmp_path), micro_batch_size=1, max_length=16, dtype="float32",
                              device="cpu")
    with pytest.raises(ValueError, match="rm3: .* has 3 labels; a reward model has one"):
        await scorer.start()


async def test_reference_similarity_on_all_minilm_l6_v2():
    scorer = SimilarityScorer("similarity", MINILM_ALIAS, batch_size=4, device="cpu")
    await scorer.start()
    try:
        result = await scorer.score([
            ScoreItem("", "", "The answer is 42.", "", "The answer is 42."),
            ScoreItem("", "", "So the total is 42 apples.", "", "There are 42 apples in total."),
            ScoreItem("", "", "I like to play football on Sundays.", "", "There are 42 apples in total."),
            ScoreItem("", "", "anything", "", ""),
        ])
    finally:
        await scorer.close()
    identical, paraphrase, unrelated, missing = result.rewards
    assert identical == pytest.approx(1.0, abs=1e-5)
    assert paraphrase > 0.6 > 0.2 > unrelated  # a real encoder tells a paraphrase from an unrelated sentence
    assert np.isnan(missing) and result.errors[3] == "similarity: no reference to compare with"
    assert resolve_encoder("/some/folder") == "/some/folder"


async def test_any_torch_module_from_a_factory_scores_queries(reward_model_path):
    """``factory``: the seed accepts any nn.Module as a reward model; the module gets the tokenized queries."""
    from transformers import AutoTokenizer

    from tests.support.reward_plugins import build_mean_embedding_reward

    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    options = {"vocab_size": len(tokenizer), "seed": 3}
    scorer = LocalModelScorer("custom", reward_model_path, micro_batch_size=2, max_length=512, dtype="float32",
                              device="cpu", factory="tests.support.reward_plugins:build_mean_embedding_reward",
                              factory_options=options)
    await scorer.start()
    result = await scorer.score(as_items(QUERIES))
    assert result.errors == (None,) * 3
    module = build_mean_embedding_reward(**options).eval()
    with torch.inference_mode():  # one query at a time, unpadded: the same rewards
        direct = [module(**tokenizer(q, return_tensors="pt")).item() for q in QUERIES]
    np.testing.assert_allclose(result.rewards, direct, atol=1e-5)
    refused = LocalModelScorer("bad", reward_model_path, micro_batch_size=2, max_length=512, dtype="float32",
                               device="cpu", factory="tests.support.reward_plugins:build_not_a_module")
    with pytest.raises(TypeError, match="returned str, not a torch.nn.Module"):
        await refused.start()

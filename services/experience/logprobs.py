"""Actor / reference log-probs (and entropy) of response tokens by a real forward pass of an HF causal LM."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from services.experience.forward import ForwardChunk

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LogProbModel:
    """A frozen causal LM that scores response tokens (the actor replica or the reference model)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    @classmethod
    def load(cls, path: str, *, dtype: str, device: str) -> LogProbModel:
        """Load ``path`` with ``AutoModelForCausalLM`` in eval mode on ``device`` (``dtype``: a key of ``DTYPES``).

        Raises:
            OSError: ``path`` is not a loadable model folder (from transformers).
            KeyError: unknown ``dtype`` (settings validate it first).
        """
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
        logger.info("loaded %s (%s, %s)", path, dtype, device)
        return cls(model)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors under their checkpoint names (``model.layers.0...``, ``lm_head.weight``)."""
        return self._model.state_dict(keep_vars=True)

    @torch.inference_mode()
    def action_log_probs(
        self, chunks: Sequence[ForwardChunk], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (nats, temperature 1) of each response token given everything before it, and optionally the
        entropy (nats) of the model's next-token distribution at each response position.

        Only the positions that predict response tokens go through the LM head (``logits_to_keep`` with the
        chunk's ``hidden_index``); ``log p = logit[token] - logsumexp(logits)`` and
        ``H = logsumexp(logits) - sum_v softmax(logits)_v * logits_v`` are computed in float32.

        Shape:
            chunks: the rows of one Rollout, in order (:func:`services.experience.forward.chunks`).
            returns ``(log_probs (B, A), entropy (B, A) or None)`` float32 on the CPU. Positions past a row's
            response are computed on padding (padded layout) or are 0 (packed) and must be masked by
            ``action_mask``.
        """
        device = self._model.device
        log_probs, entropies = [], []
        for chunk in chunks:
            logits = self._model(
                input_ids=chunk.input_ids.to(device),
                attention_mask=chunk.model_mask(self._model.dtype, device),
                position_ids=chunk.position_ids.to(device),
                logits_to_keep=chunk.hidden_index.to(device),
                use_cache=False,
            ).logits.float()  # (b, K, V)
            normalizer = torch.logsumexp(logits, dim=-1)
            chosen = logits.gather(-1, chunk.targets.to(device).unsqueeze(-1)).squeeze(-1)
            log_probs.append(chunk.to_rows((chosen - normalizer).cpu()))
            if with_entropy:
                expected_logit = (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
                entropies.append(chunk.to_rows((normalizer - expected_logit).cpu()))
        return torch.cat(log_probs), torch.cat(entropies) if with_entropy else None

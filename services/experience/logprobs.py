"""Actor / reference log-probs of response tokens by a real forward pass of an HF causal LM."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LogProbModel:
    """A frozen causal LM that scores response tokens (the actor replica or the reference model)."""

    def __init__(self, model: Any, micro_batch_size: int) -> None:
        self._model = model
        self._micro_batch_size = micro_batch_size

    @classmethod
    def load(cls, path: str, *, dtype: str, device: str, micro_batch_size: int) -> LogProbModel:
        """Load ``path`` with ``AutoModelForCausalLM`` in eval mode on ``device``."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype]).to(device).eval()
        logger.info("loaded %s (%s, %s)", path, dtype, device)
        return cls(model, micro_batch_size)

    @torch.inference_mode()
    def action_log_probs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """Log-probs (nats, temperature 1) of the last ``num_actions`` tokens of each row given everything before.

        Position ids count real tokens only (``cumsum(attention_mask) - 1``), so left padding does not shift
        positions. Only the last ``num_actions + 1`` positions go through the LM head (``logits_to_keep``), and
        ``log p = logit[token] - logsumexp(logits)`` is computed in float32.

        Shape:
            sequences, attention_mask: (B, S) int64; returns (B, A) float32 with ``A = num_actions``.
            Positions past a row's response are computed on padding and must be masked by ``action_mask``.
        """
        device = self._model.device
        out = []
        for start in range(0, sequences.shape[0], self._micro_batch_size):
            ids = sequences[start : start + self._micro_batch_size].to(device)
            mask = attention_mask[start : start + self._micro_batch_size].to(device)
            position_ids = (mask.cumsum(dim=1) - 1).clamp_(min=0)
            logits = self._model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=num_actions + 1
            ).logits[:, :-1].float()  # (b, A, V): position t predicts token t + 1
            targets = ids[:, -num_actions:].unsqueeze(-1)
            out.append((logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)).cpu())
        return torch.cat(out)
